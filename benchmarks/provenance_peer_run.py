"""Run by the kit's own interpreter (:mod:`benchmarks.provenance_peer`): cisco-ai-provenance-kit's
``provenancekit compare`` pipeline (one ``ModelProvenanceScanner`` with ``NullCache``) on local
checkpoints, offline. ``python provenance_peer_run.py < job.json``, job ``{"pairs": [[A, B], ...],
"threads": 1}``. Prints JSON lines: ``{"versions": ...}``, then per pair ``{"index", "result"}``
(the kit's ``format_json``) or ``{"index", "error"}``, with ``seconds``, the kit's ``warnings``
(structlog, level warning and above) and ``network`` (connection attempts, refused).
"""
import json
import logging
import socket
import sys
import time

ATTEMPTS: list = []


def _refuse(self, address, *args, **kwargs):
    ATTEMPTS.append(repr(address))
    raise OSError(f"network disabled by the benchmark (offline run): {address!r}")


socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse

WARNINGS: list = []


def _collect(logger, method, event):
    WARNINGS.append(" ".join(f"{k}={v}" for k, v in event.items() if k not in ("timestamp",)))
    raise __import__("structlog").DropEvent


def main() -> int:
    job = json.load(sys.stdin)
    import importlib.metadata as md

    import structlog
    import torch
    torch.set_num_threads(int(job.get("threads", 1)))
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        processors=[structlog.processors.add_log_level, _collect])
    from provenancekit.config.settings import Settings
    from provenancekit.core.results.formatters import format_json
    from provenancekit.core.scanner import ModelProvenanceScanner
    from provenancekit.services.cache import NullCache
    from provenancekit.services.model_loader import is_local_hf_snapshot

    versions = {p: md.version(p) for p in ("cisco-ai-provenance-kit", "torch", "transformers", "huggingface-hub")}
    versions["python"] = sys.version.split()[0]
    print(json.dumps({"versions": versions}), flush=True)
    scanner = ModelProvenanceScanner(settings=Settings(), cache=NullCache())
    for i, (a, b) in enumerate(job["pairs"]):
        t0, n_net, n_warn = time.perf_counter(), len(ATTEMPTS), len(WARNINGS)
        rec: dict = {"index": i}
        try:
            for p in (a, b):
                if not is_local_hf_snapshot(p):
                    raise ValueError(f"not a local checkpoint (no config.json): {p}")
            rec["result"] = json.loads(format_json(scanner.compare(a, b)))
        except Exception as exc:  # noqa: BLE001 - one pair's failure is that pair's row
            rec["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
        rec.update(seconds=time.perf_counter() - t0, warnings=WARNINGS[n_warn:], network=ATTEMPTS[n_net:])
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
