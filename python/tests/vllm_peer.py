"""The prefill engine (kv_producer) of the two-process vLLM tests (test_vllm_pair.py): a
vllm_engine.Engine with kvstream.vllm as its connector, driven by JSON lines on stdin:

    vllm_peer.py MODEL_DIR '{"fmt": "cpu", "kv_port": 0, "extra": {...}}'
    -> PEER ready <kvstream control address>
    {"cmd": "add", "id": "p1", "prompt": [...], "max_tokens": 1, "params": {...}}
    {"cmd": "run", "timeout_s": 60}      steps until the engine has nothing left to do
    -> PEER finished {"id": ..., "kv_transfer_params": ...}   as requests finish
    -> PEER idle {"free_blocks": n, "steps": n, "stats": {...}}
    {"cmd": "quit"}
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_engine  # noqa: E402


def say(kind, payload):
    print(f"PEER {kind} {payload}", flush=True)


def main():
    model_dir, options = sys.argv[1], json.loads(sys.argv[2])
    engine = vllm_engine.Engine(model_dir, "kv_producer", fmt=options.get("fmt", "cpu"),
                                extra=options.get("extra"), kv_port=options.get("kv_port", 0),
                                engine_id="prefill-0")
    say("ready", engine.worker.worker_side.control_address)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "add":
            engine.add(cmd["id"], cmd["prompt"], max_tokens=cmd.get("max_tokens", 1),
                       kv_transfer_params=cmd.get("params"))
        elif cmd["cmd"] == "run":
            reported = set()

            def report():
                for rid, o in engine.finished.items():
                    if rid not in reported:
                        reported.add(rid)
                        say("finished", json.dumps({"id": rid,
                                                    "kv_transfer_params": o.kv_transfer_params}))
                return not engine.busy()

            engine.run_until(report, cmd.get("timeout_s", 60))
            stats = engine.worker.worker_side.worker.stats()
            say("idle", json.dumps({"free_blocks": engine.free_blocks(), "steps": engine.steps,
                                    "layers_sent": stats["layers_sent"],
                                    "bytes_sent": stats["bytes_sent"]}))
        elif cmd["cmd"] == "quit":
            break
    engine.worker.shutdown()


if __name__ == "__main__":
    main()
