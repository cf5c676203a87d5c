"""Distributed benchmark: the target on an RPC server behind a latency-injecting relay.

`tc netem` is not available on these machines, so the delay comes from a relay in user space:
every chunk each side sends is held for the given one-way delay before it is passed on (in order,
without limiting bandwidth). For each delay (0, 1, 5 and 20 ms each way by default) the target
alone, n-gram drafting and model drafting run through the same relay, each a fresh `localspec`
process after one warm-up run (the cost profile of a remote target includes the round trips,
so the planner drafts deeper as latency grows). Reported: decode tokens/s, speedup against the
target alone at that delay, target passes per generated token, the mean draft depth the planner
chose, and the cost model's prediction from the learned profile.

    python benchmarks/distributed.py                         # needs an RPC build of llama-cpp-python
    python benchmarks/distributed.py --delays 0,20 --repeat 1 --tokens 96
    python benchmarks/distributed.py --relay-only 6000 127.0.0.1:50052 20   # just the relay

On this 2-core machine a verification pass stays compute-bound and the rpc-server shares the
cores with the client; the table ends with the cost model's prediction for a remote GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from localspec.decoding.acceptance import Acceptance
from localspec.decoding.costs import CostTable
from localspec.decoding.profiles import Profiles
from localspec.llama import registry

from benchmarks.common.prompts import WHOLE_PROCESS as PROMPTS
from benchmarks.common.runs import localspec_json, profile_env

DELAYS = (0.0, 1.0, 5.0, 20.0)  # ms, each way
CONFIGS = {  # name: extra localspec arguments
    "target alone": ["-d", "none", "-k", "0"],
    "n-gram": ["-d", "none", "--drafter", "ngram"],
    "model": ["--drafter", "model"],
    # the planner overruled: what model drafting really costs here (the planner declines it on this CPU)
    "model fixed k=4": ["--drafter", "model", "--plan", "fixed", "-k", "4"],
}
CODE_PROMPTS = ("code",)
GROUNDED_PROMPTS = ("code-edit",)


# ---------------------------------------------------------------- the relay


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader to writer, each chunk held `delay` seconds (order kept, bandwidth not limited)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(data)
            await writer.drain()
        writer.close()

    task = asyncio.ensure_future(deliver())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic() + delay, data))
    except (ConnectionError, OSError):
        pass
    queue.put_nowait((0.0, None))
    await task


async def _relay(listen_port: int, upstream: str, delay_ms: float, ready: threading.Event) -> None:
    host, port = upstream.rsplit(":", 1)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        up_writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(_pipe(reader, up_writer, delay_ms / 1e3), _pipe(up_reader, writer, delay_ms / 1e3),
                             return_exceptions=True)

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    ready.set()
    async with server:
        await server.serve_forever()


def start_relay(listen_port: int, upstream: str, delay_ms: float) -> None:
    """A relay on 127.0.0.1:listen_port in a daemon thread."""
    ready = threading.Event()
    threading.Thread(target=lambda: asyncio.run(_relay(listen_port, upstream, delay_ms, ready)), daemon=True).start()
    if not ready.wait(10):
        raise RuntimeError("the relay did not start")


# ---------------------------------------------------------------- runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rpc_server(threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "localspec", "rpc-server", "--port", str(port), "--threads",
                             str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the RPC server did not start")


def run_localspec(args: Sequence[str], prompt: str, profile_dir: Path) -> dict:
    """A fresh `localspec --json` process (benchmarks.common.runs) at T = 0: its JSON answer."""
    return localspec_json(["--json", "-t", "0", "--seed", "1", *args, prompt], env=profile_env(profile_dir)).data


def predicted(profile_dir: Path, endpoint: str, stats: dict) -> float:
    """Tokens/s the cost model predicts for what the run did: its target passes priced by the
    learned profile of the remote target (one-token passes at c(1), drafting passes at the cost
    of their mean size), plus the draft model's levels at its profile's cost per level."""
    found = Profiles(profile_dir).on_disk()
    remote = [p for p in found if endpoint in p.identity.get("rpc", [])]
    if not remote or not stats["target_passes"]:
        return 0.0
    costs = CostTable(remote[0].costs)
    drafting = sum(stats["accept_histogram"])
    seconds = (stats["target_passes"] - drafting) * costs(1)
    if drafting:
        seconds += drafting * costs(round(1 + stats["drafted_tokens"] / drafting))
        local = [p for p in found if not p.identity.get("rpc") and 1 in p.costs]
        seconds += stats["drafted_tokens"] * (local[0].costs[1] if local else 0.0)
    return stats["generated_tokens"] / seconds if seconds > 0 else 0.0


def measure(args: argparse.Namespace, workdir: Path) -> list[dict]:
    server, endpoint = start_rpc_server(args.server_threads)
    rows = []
    try:
        for delay in args.delays:
            relay_port = free_port()
            start_relay(relay_port, endpoint, delay)
            relay = f"127.0.0.1:{relay_port}"
            for prompt_name in (*CODE_PROMPTS, *GROUNDED_PROMPTS):
                for config, extra in CONFIGS.items():
                    if config not in args.configs and config != "target alone":
                        continue
                    if config == "n-gram" and prompt_name in CODE_PROMPTS:
                        continue  # fresh code repeats nothing: n-gram drafting is for grounded prompts
                    profile_dir = workdir / f"{delay:g}-{config}"
                    base = ["--rpc", relay, "-n", str(args.tokens), "--threads", str(args.threads), *extra]
                    print(f"delay {delay:g} ms, {prompt_name}, {config}: warm-up", file=sys.stderr, flush=True)
                    run_localspec(base, PROMPTS[prompt_name], profile_dir)
                    runs = [run_localspec(base, PROMPTS[prompt_name], profile_dir) for _ in range(args.repeat)]
                    stats = [r["stats"] for r in runs]
                    med = {k: statistics.median(s[k] for s in stats)
                           for k in ("tokens_per_second", "block_efficiency", "drafted_tokens", "target_passes")}
                    steps_drafting = sum(sum(s["accept_histogram"]) for s in stats)
                    rows.append(dict(delay=delay, prompt=prompt_name, config=config, tps=med["tokens_per_second"],
                                     passes_per_token=1 / med["block_efficiency"] if med["block_efficiency"] else 0,
                                     depth=(sum(s["drafted_tokens"] for s in stats) / steps_drafting)
                                     if steps_drafting else 0.0,
                                     predicted=predicted(profile_dir, relay, stats[len(stats) // 2])))
    finally:
        server.kill()
    return rows


def table(rows: Sequence[dict]) -> list[str]:
    out = ["| one-way delay | prompt | configuration | decode tok/s | vs target alone | target passes / token | "
           "mean draft depth | cost model tok/s |", "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = next(b["tps"] for b in rows if b["delay"] == r["delay"] and b["prompt"] == r["prompt"]
                    and b["config"] == "target alone")
        out.append(f"| {r['delay']:g} ms | {r['prompt']} | {r['config']} | {r['tps']:.1f} | "
                   f"**{r['tps'] / base:.2f}×** | {r['passes_per_token']:.2f} | {r['depth']:.1f} | {r['predicted']:.1f} |")
    return out


def best_depth(target: CostTable, rtt: float, alpha: float, level: float) -> tuple[int, float]:
    """The draft depth (1-16) with the best predicted tokens per second, and that rate: each pass
    costs the target's pass and one round trip of `rtt` seconds, each draft level `level`
    seconds, and each level is accepted with probability `alpha`."""
    acc = Acceptance(prior=1 - alpha)
    rate, depth = max((acc.expected(d, 0) / (target(d + 1) + rtt + d * level), d) for d in range(1, 17))
    return depth, rate


def gpu_prediction(delays: Sequence[float]) -> list[str]:
    """The cost model for a remote H100 target (the default pair's measured GPU costs: target
    passes of 1/2/4/5/8/9/16 tokens = 2.3/2.5/3.0/3.3/3.7/4.7/4.6 ms; a local draft level 1.15 ms),
    each pass one round trip, at a per-level acceptance of 0.9 for n-gram copies and 0.8 for the
    draft model, drafts of up to 16 tokens."""
    gpu = CostTable({1: 2.3e-3, 2: 2.5e-3, 4: 3.0e-3, 5: 3.3e-3, 8: 3.7e-3, 9: 4.7e-3, 16: 4.6e-3})
    out = ["| one-way delay | target alone tok/s | n-gram copies (0.9 per level): best depth, speedup | "
           "draft model (0.8 per level): best depth, speedup |", "| ---: | ---: | ---: | ---: |"]
    for delay in delays:
        rtt = 2 * delay / 1e3
        plain = 1 / (gpu(1) + rtt)
        (dn, rn), (dm, rm) = best_depth(gpu, rtt, 0.9, 0.0), best_depth(gpu, rtt, 0.8, 1.15e-3)
        out.append(f"| {delay:g} ms | {plain:.0f} | {dn}, {rn / plain:.2f}× | {dm}, {rm / plain:.2f}× |")
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delays", type=lambda s: [float(x) for x in s.split(",")], default=list(DELAYS),
                   help="one-way delays in ms (default 0,1,5,20)")
    p.add_argument("--repeat", type=int, default=2, help="measured runs per cell (default 2; medians)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="client threads (the draft)")
    p.add_argument("--server-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS),
                   help=f"comma list (default all: {','.join(CONFIGS)}; the target alone always runs)")
    p.add_argument("--relay-only", nargs=3, metavar=("PORT", "UPSTREAM", "DELAY_MS"),
                   help="run only a relay (for real machines: see docs/distributed.md)")
    args = p.parse_args(argv)
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.relay_only:
        port, upstream, delay = args.relay_only
        start_relay(int(port), upstream, float(delay))
        print(f"relay 127.0.0.1:{port} -> {upstream}, {delay} ms each way; Ctrl-C stops", file=sys.stderr)
        threading.Event().wait()
        return 0
    registry.resolve(registry.load_registry().pairs[registry.load_registry().default_pair].draft)
    with tempfile.TemporaryDirectory(prefix="localspec-distributed-") as tmp:
        rows = measure(args, Path(tmp))
    print("\n".join(table(rows)))
    print()
    print("\n".join(gpu_prediction(args.delays)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
