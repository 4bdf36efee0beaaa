"""Start the OpenAI-compatible server in-process (uvicorn in a background thread) on a free loopback port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


# a ChatML template for the tiny test models (their tokenizer has <|im_start|> / <|im_end|>)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_chat_template(model_dir, dest):
    """A copy of the model folder ``model_dir`` at ``dest`` with ``CHATML`` as its chat template; returns ``dest``."""
    import shutil
    from pathlib import Path

    shutil.copytree(model_dir, dest)
    (Path(dest) / "chat_template.jinja").write_text(CHATML)
    return Path(dest)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app):
    """Yield ``http://127.0.0.1:PORT`` while uvicorn serves ``app`` in a thread; stop it afterwards."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
