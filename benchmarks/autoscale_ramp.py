"""A 1 -> 2 -> 1 replica load ramp (issue 39's target: 0 failed requests; how long a
new replica takes to serve).

    python benchmarks/autoscale_ramp.py                   # defaults below
    python benchmarks/autoscale_ramp.py --upscale-delay 1 --downscale-delay 5 --json out.json

Starts ``kvserve serve --min-replicas 1 --max-replicas 2`` (default model, a local Ray
cluster on 127.0.0.1, a free port, 1 thread per replica, the step-time budget on),
then runs :func:`kvserve.bench.ramp.run_ramp`: a burst of streamed requests until the
new replica has served, then a light load until Serve has drained and removed a
replica. Prints the new replica's time to serve, broken down (constructor began:
upscale decision + actor start; constructor: model load, step-time fit, engine
start; first request served), the drain and the failures. Timings on a shared
machine are noisy: run it on a quiet one (the repo's /tmp/kvserve-measuring lock).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvserve.bench.process import free_port, stop_process, wait_healthy  # noqa: E402
from kvserve.bench.ramp import run_ramp  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-ongoing-requests", type=float, default=3.0)
    p.add_argument("--upscale-delay", type=float, default=1.0)
    p.add_argument("--downscale-delay", type=float, default=3.0)
    p.add_argument("--look-back", type=float, default=3.0)
    p.add_argument("--burst-clients", type=int, default=4)
    p.add_argument("--burst-tokens", type=int, default=16)
    p.add_argument("--trickle-clients", type=int, default=2)
    p.add_argument("--trickle-tokens", type=int, default=64)
    p.add_argument(
        "--cache-dir",
        default=None,
        help="KVSERVE_CACHE_DIR of the replicas (default: the user's, so a stored "
        "step-time fit is reused as in production; 'fresh' for an empty one)",
    )
    p.add_argument("--json", default=None, help="also write the summary here")
    p.add_argument("--log", default=None, help="the server's log (default: a temp file)")
    args = p.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if args.cache_dir == "fresh":
        env["KVSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvserve-ramp-cache-")
    elif args.cache_dir:
        env["KVSERVE_CACHE_DIR"] = args.cache_dir
    cmd = [
        sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port),
        "--min-replicas", "1", "--max-replicas", "2", "--threads-per-replica", "1",
        "--target-ongoing-requests", str(args.target_ongoing_requests),
        "--upscale-delay", str(args.upscale_delay),
        "--downscale-delay", str(args.downscale_delay),
        "--autoscale-look-back", str(args.look_back),
        "--graceful-shutdown-timeout", "30",
        "--num-kv-blocks", "256", "--max-model-len", "512", "--no-access-log",
    ]  # fmt: skip
    if args.log:
        log_path = Path(args.log)
    else:
        with tempfile.NamedTemporaryFile(prefix="kvserve-ramp-", suffix=".log", delete=False) as f:
            log_path = Path(f.name)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        try:
            wait_healthy(base, proc, 300, poll_s=0.5, log_tail=lambda: log_path.read_text()[-3000:])
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        print(f"autoscaled endpoint up in {time.monotonic() - t0:.1f} s ({log_path})")
        result = run_ramp(
            base,
            burst_clients=args.burst_clients,
            burst_tokens=args.burst_tokens,
            trickle_clients=args.trickle_clients,
            trickle_tokens=args.trickle_tokens,
        )
    finally:
        stop_process(proc, timeout_s=60)
    summary = result.summary()
    summary["flags"] = {k: v for k, v in vars(args).items() if k not in ("json", "log")}
    print(json.dumps(summary, indent=1))
    print(
        f"new replica: constructor began {summary['new_replica_constructor_began_s']} s after "
        f"the burst began, took {summary['new_replica_constructor_s']} s "
        f"(step-time fit: {summary['new_replica_step_fit']}), first request served at "
        f"{summary['new_replica_first_served_s']} s; scale-down: left the router at "
        f"{summary['removed_left_router_s']} s, gone at {summary['removed_gone_s']} s; "
        f"failed requests: {summary['failed']} of {sum(summary['requests'].values())}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    ok = (
        summary["failed"] == 0
        and summary["new_replica_first_served_s"] is not None
        and summary["removed_gone_s"] is not None
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
