"""A stand-in SGLang server for a given release (SGLang cannot run on these machines): the fleet
launches it as `rollout.sglang_command=[python, this file, RELEASE]` and it answers with SGLang's
launch flags the way SGLang's http_server does on the routes the fleet reads at start (/health,
/get_server_info with `version`, /get_model_info). It holds no model and serves nothing else.

    python tests/sglang_release_server.py 0.4.0 --model-path M --host 127.0.0.1 --port 30000 ...
"""

from __future__ import annotations

import argparse

import uvicorn
from fastapi import FastAPI


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("release")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    args, _ = parser.parse_known_args()  # the fleet's other SGLang flags (sizes, load format) are not used
    app = FastAPI()
    server_info = {
        "version": args.release,
        "frontend": "python",
        "model_path": args.model_path,
        "tp_size": args.tp_size,
    }
    app.get("/health")(lambda: None)
    app.get("/get_server_info")(lambda: server_info)
    app.get("/get_model_info")(lambda: {"model_path": args.model_path, "is_generation": True})
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
