# ruff: noqa: RUF001 (look-alike characters are the point of this corpus)
"""Texts a serving layer is tempted to rewrite, for the conformance tests: what reaches
the engine through tokenbus must be what reaches it through vLLM's own server."""

from __future__ import annotations

from typing import Any

TEXTS: dict[str, str] = {
    "ascii": "What is a Kafka partition? Explain it in two sentences.",
    "cjk_width_forms": "東京の天気は？ ＡＢＣ１２３ ｶﾀｶﾅ ﾊﾝｶｸ 한국어 ﾟ",
    "emoji_zwj": "family 👨\u200d👩\u200d👧\u200d👦, flag 🏳\ufe0f\u200d🌈, coder 👩🏽\u200d💻",
    "rtl": "مرحبا بالعالم \u200fشلום עולם\u200e done",
    "combining_marks": "e\u0301cole, n\u0303, Z\u0351\u0322a\u0300lgo, \u1100\u1161 ﬁle",
    "invisible": "zero\u200bwidth\u200cnon\u200djoiner soft\u00adhyphen \u2066isolate\u2069",
}

CHATS: dict[str, list[dict[str, Any]]] = {
    **{name: [{"role": "user", "content": text}] for name, text in TEXTS.items()},
    "system_and_history": [
        {"role": "system", "content": "You answer in one line. ＦＵＬＬ width is fine."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven 7\u20e3."},
        {"role": "user", "content": "Another, e\u0301 please \U0001f9d1\u200d\U0001f680"},
    ],
    "multi_part": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first part ＡＢ"},
                {"type": "text", "text": "second part \u200d end"},
            ],
        }
    ],
}

PROMPTS: dict[str, str] = {f"completion_{name}": text for name, text in TEXTS.items()}
