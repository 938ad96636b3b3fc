"""What one admit + settle pair costs the gateway's event loop in its own Python, with Triton left out: the
front's lease operations as the front builds them (front/engine_direct.py), read and decided by the
gateway's code (gateway/request.py, gateway/core.py Gateway.answers) in one process, hot.

The gateway's one process admits and settles every request of a server (docs/benchmarks.md: at short
requests it bounds the server's requests a second), and what it spends per pair is mostly this Python; the
served figure (`admission_bench.py`) adds Triton's IPC and moves with the host's load, while this one is
stable enough to compare commits. Per group size G: G admits (alone when G is 1, else one grouped admit,
as the front sends them while the gateway is behind) and their settles in one grouped settle, repeated;
reports the loop thread's CPU µs per pair, and with --profile the functions that spend it.

    python benchmarks/gateway_policy_bench.py [--groups 1,16] [--pairs 20000] [--repeat 5] [--profile]
        [--out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, write_json  # noqa: E402
from benchmarks.triton_bench import BENCH_KEY, bench_gateway_config  # noqa: E402
from build.prepare_model import DEFAULT_CHECKPOINT  # noqa: E402
from front.engine_direct import LEASE_CALL, DirectEngine, _Admit, _parameters  # noqa: E402
from front.gateway_client import gateway_values  # noqa: E402
from front.openai_schema import GatewayCall  # noqa: E402
from front.prompt_prep import PromptPreparer  # noqa: E402
from gateway.admission import Admission  # noqa: E402
from gateway.core import Gateway  # noqa: E402
from gateway.metrics import AppliedInBackground, GatewayMetrics, MemoryRegistry  # noqa: E402
from gateway.ratelimit import MemoryLimiter  # noqa: E402
from gateway.request import grouped_admits, json_arrays, parse_gateway_request  # noqa: E402
from gateway.tenants import ConfigWatcher, hash_key  # noqa: E402
from gateway.triton_backend import TritonBackend  # noqa: E402
from text.detokenize import Detokenizer  # noqa: E402
from text.preprocess import Preprocessor  # noqa: E402
from text.tokenization import TokenizerBundle  # noqa: E402

FRONT_KEY = "fk-bench"
PROMPT = "Say hello in one short sentence, please."


class Bench:
    def __init__(self, tokenizer_dir: Path, config: Path):
        tokenizer = TokenizerBundle.load(tokenizer_dir)
        self.prepare = PromptPreparer(Preprocessor(tokenizer, None))
        self.prepare.granted(BENCH_KEY)
        detok = Detokenizer.from_tokenizer(tokenizer.tokenizer)
        backend = TritonBackend(None, vocab_size=detok.vocab_size, max_output_len=4096)
        self.metrics = AppliedInBackground(MemoryRegistry(), interval_s=3600)  # applied between rounds
        self.gateway = Gateway(ConfigWatcher(str(config)).get, MemoryLimiter(), Admission(4096, 4096, 30.0),
                               GatewayMetrics(self.metrics), backend, detok, front_key_sha256=hash_key(FRONT_KEY))
        self.call = GatewayCall(text=PROMPT, max_tokens=128)

    def _admit(self) -> _Admit:
        lease = {"prep": self.prepare(self.call, BENCH_KEY)}
        return _Admit(self.call, BENCH_KEY, uuid.uuid4().hex, lease)

    async def _answers(self, values: dict, parameters: dict) -> list[dict]:
        """What the gateway answers an operation: its request read as the adapter reads it, its answers; the
        loop thread's CPU for it is added to `spent`."""
        start = time.thread_time()
        req, operation = parse_gateway_request(json_arrays(values), parameters)
        answers = [out["text_output"][0][0] async for out, _ in self.gateway.answers(operation, req, None, grouped_admits)]
        self.spent += time.thread_time() - start
        return [orjson.loads(a) for a in answers]

    def admits(self, group: int) -> tuple[dict, dict]:
        """The front's request for `group` admits (its values and parameters), built as the front builds it."""
        admits = [self._admit() for _ in range(group)]
        if group == 1:
            a = admits[0]
            return gateway_values(a.call, "admit"), {**_parameters(a.call, a.api_key, {"stream_id": a.name}),
                                                     "front_key": FRONT_KEY, "lease": orjson.dumps(a.lease).decode()}
        items = b",".join(DirectEngine._admit_item(a) for a in admits)
        return gateway_values(LEASE_CALL, "admit"), _parameters(
            LEASE_CALL, None, {"front_key": FRONT_KEY, "lease": (b'{"admits":[' + items + b"]}").decode()})

    async def pairs(self, group: int, request: tuple[dict, dict]) -> None:
        """`group` admits (`request`), then their settles in one grouped settle."""
        answers = await self._answers(*request)
        leases = [answers[0]["lease"]] if group == 1 else \
            [g["lease"] for answer in answers for g in answer["admits"].values()]
        assert len(leases) == group, leases
        reports = [{"id": lease, "num_output_tokens": 128, "outcome": "success", "error_kind": "",
                    "finish_reason": "length", "ttft_s": 0.05, "itl_s": 0.01} for lease in leases]
        params = _parameters(LEASE_CALL, None, {"front_key": FRONT_KEY,
                                                "lease": orjson.dumps({"leases": reports}).decode()})
        settled = (await self._answers(gateway_values(LEASE_CALL, "settle"), params))[0]["settled"]
        assert len(settled) == group and all("error" not in s for s in settled), settled

    async def run(self, group: int, pairs: int, profile: cProfile.Profile | None = None) -> float:
        """The gateway's CPU µs per pair over `pairs` pairs in groups of `group` (the front's side of each,
        its prompt tokenized and its requests built, is made before and not counted)."""
        requests = [self.admits(group) for _ in range(max(1, pairs // group))]
        self.spent = 0.0
        if profile is not None:
            profile.enable()
        for request in requests:
            await self.pairs(group, request)
        if profile is not None:
            profile.disable()
        self.metrics.flush()
        return self.spent / (len(requests) * group) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", default="1,16", help="admits per group (1: each admit alone)")
    p.add_argument("--pairs", type=int, default=20000, help="admit + settle pairs per run")
    p.add_argument("--repeat", type=int, default=5, help="runs per group size (the report keeps each)")
    p.add_argument("--tokenizer-dir", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--profile", action="store_true", help="also print cProfile's top functions per group size")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    groups = [int(g) for g in args.groups.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args.tokenizer_dir, bench_gateway_config(Path(tmp) / "gateway.yaml"))

        async def measure():
            out = []
            for group in groups:
                await bench.run(group, min(args.pairs, 2000))  # warm: caches, the tenant's state
                runs = [round(await bench.run(group, args.pairs), 2) for _ in range(args.repeat)]
                print(f"group {group}: {min(runs)} µs a pair (runs {runs})", file=sys.stderr)
                row = {"group": group, "pairs": args.pairs, "us_per_pair": runs}
                if args.profile:
                    prof = cProfile.Profile()
                    await bench.run(group, args.pairs // 4, prof)
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
                    print(text.getvalue(), file=sys.stderr)
                    row["python_calls_per_pair"] = round(
                        sum(s[1] for s in pstats.Stats(prof).stats.values()) / (args.pairs // 4 // group * group), 1)
                out.append(row)
            return out

        rows = asyncio.run(measure())
    report = {"machine": machine(), "command": "python benchmarks/gateway_policy_bench.py " + " ".join(argv or sys.argv[1:]),
              "runs": rows}
    if args.out:
        write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
