"""Tiny random LoRA adapters for the tiny model, built offline, so tests and benchmarks
exercise vLLM's LoRA path with no download.

Each adapter is a PEFT-format folder (``adapter_config.json`` and
``adapter_model.safetensors``): rank 8 on the attention's q and v projections of every
layer. PEFT starts ``lora_B`` at zero, which would leave the output unchanged; here both
matrices are random (seeded by the adapter's name), so an adapter's greedy output
differs from the base model's, and from every other adapter's.

    python -m workers.tiny_adapter MODEL_DIR OUT_DIR NAME [NAME ...]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

RANK = 8
ALPHA = 16
TARGET_MODULES = ("q_proj", "v_proj")
COMPLETE_MARKER = ".complete"


def build_tiny_adapter(model_dir: Path, out_dir: Path, name: str) -> Path:
    """Builds adapter ``name`` for the model in ``model_dir`` into ``out_dir`` (once)."""
    out_dir = Path(out_dir)
    if (out_dir / COMPLETE_MARKER).is_file():
        return out_dir
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    num_kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    out_features = {"q_proj": hidden, "v_proj": num_kv_heads * head_dim}
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(RANK, hidden, generator=generator) / hidden**0.5
            b = torch.randn(out_features[module], RANK, generator=generator) / RANK**0.5
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGET_MODULES),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its target and renamed: a crash never leaves half an adapter there.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        tmp.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / COMPLETE_MARKER).is_file():  # another builder won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3:
        print("usage: python -m workers.tiny_adapter MODEL_DIR OUT_DIR NAME [NAME ...]")
        return 2
    model_dir, out_root = Path(args[0]), Path(args[1])
    for name in args[2:]:
        path = build_tiny_adapter(model_dir, out_root / name, name)
        print(f"adapter {name} ready at {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
