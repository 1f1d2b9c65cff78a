"""The stream-environment side of the direct arm: starts ``bench.direct_vllm --serve`` in
the worker environment and talks to it over stdin and a result pipe."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from pathlib import Path
from typing import IO, Any

from tokenbus.config import Settings
from tokenbus_cli.stack import REPO_ROOT, settings_env, worker_python


class DirectArmError(RuntimeError):
    pass


class DirectProcess:
    def __init__(self, settings: Settings, log_path: Path) -> None:
        read_fd, write_fd = os.pipe()
        self.log_path = log_path
        env = {**settings_env(settings), **settings.worker_env}  # as the stack's workers
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        with log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                [
                    str(worker_python(settings)),
                    "-m",
                    "bench.direct_vllm",
                    "--serve",
                    "--result-fd",
                    str(write_fd),
                ],
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                env=env,
                cwd=REPO_ROOT,
                start_new_session=True,
            )
        os.close(write_fd)
        self._results: IO[str] = os.fdopen(read_fd, "r")
        self.pid = self.process.pid
        self.engine_pids: list[int] = []

    async def _read(self) -> dict[str, Any]:
        line = await asyncio.to_thread(self._results.readline)
        if not line:
            tail = self.log_path.read_text(errors="replace").splitlines()[-30:]
            raise DirectArmError("direct arm exited; log tail:\n" + "\n".join(tail))
        result: dict[str, Any] = json.loads(line)
        return result

    async def _ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        self.process.stdin.flush()
        return await self._read()

    async def ready(self) -> None:
        hello = await self._read()
        self.engine_pids = list(hello["engine_pids"])

    async def wave(
        self, prompts: list[str], concurrency: int, max_tokens: int, tenant: str
    ) -> dict[str, Any]:
        return await self._ask(
            {
                "op": "wave",
                "prompts": prompts,
                "concurrency": concurrency,
                "max_tokens": max_tokens,
                "tenant": tenant,
            }
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            with contextlib.suppress(OSError):
                self.process.stdin.write(b'{"op": "quit"}\n')
                self.process.stdin.flush()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, 9)
                self.process.wait()
        self._results.close()
