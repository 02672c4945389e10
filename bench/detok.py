"""The gateway's detokenizer: a worker's chunk fed a token at a time (the gateway before
2026-12-05) against the whole chunk at once (``Detokenizer.feed``), per tokenizer and chunk
length, without stop strings and with one that the text does not hold (``STOP``, as an agent's
"Observation:" that has not come yet). A chunk of n tokens is what a call that is not streamed
gets in its last message; a streamed call gets a chunk per ``stream_interval_s``.

Each variant decodes the same chunk (cut to end on a whole character: a chunk ending inside one
is held, and with a stop string decoded a token at a time) after 5 prompt ids of context and
``finish``es, ``--rounds`` times, taking turns; the table gives the median microseconds per
token and the ratio. The two must give the same text (checked).

Usage: python -m bench.detok [--models tiny,smollm2] [--lengths 16,256] [--rounds 200]
(under a minute). Prints a table and writes bench/results/detok.json.
"""

import argparse
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.machine import machine
from bench.output import write_results
from common.models import build_tiny_model, load_tokenizer, resolve_model
from rollout.gateway.detok import REPLACEMENT, Detokenizer

TEXT = "The quick brown fox jumps over the lazy dog; héllo 日本. " * 40
STOP = "Observation:"


def one_at_a_time(tok, context: list[int], chunk: list[int], stop: list[str]) -> str:
    detok = Detokenizer(tok, stop, context)
    return "".join(detok.feed([token_id]).text for token_id in chunk) + detok.finish()


def whole(tok, context: list[int], chunk: list[int], stop: list[str]) -> str:
    detok = Detokenizer(tok, stop, context)
    return detok.feed(chunk).text + detok.finish()


def measure(tok, context: list[int], chunk: list[int], stop: list[str], rounds: int) -> dict:
    """Median microseconds per token of each variant, taking turns."""
    if one_at_a_time(tok, context, chunk, stop) != whole(tok, context, chunk, stop):
        raise SystemExit(f"{len(chunk)} tokens, stop {stop}: the two variants differ")
    times: dict[str, list[float]] = {"one_at_a_time": [], "whole_chunk": []}
    for _ in range(rounds):
        for name, variant in (("one_at_a_time", one_at_a_time), ("whole_chunk", whole)):
            start = time.perf_counter()
            variant(tok, context, chunk, stop)
            times[name].append(time.perf_counter() - start)
    us = {k: statistics.median(v) / len(chunk) * 1e6 for k, v in times.items()}
    return {
        **{f"{k}_us_per_token": round(v, 2) for k, v in us.items()},
        "ratio": round(us["one_at_a_time"] / us["whole_chunk"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--lengths", default="16,256")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    loadavg = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="sf-bench-detok-") as tmp:
        for model in args.models.split(","):
            path = build_tiny_model(Path(tmp) / "tiny") if model == "tiny" else None
            tok = load_tokenizer(path or resolve_model(model))
            ids = tok.encode(TEXT, add_special_tokens=False)
            lengths = map(int, args.lengths.split(","))
            for n, stop in itertools.product(lengths, ([], [STOP])):
                chunk = ids[5 : 5 + n]
                while tok.decode(chunk).endswith(REPLACEMENT):  # end on a whole character
                    chunk.pop()
                row = measure(tok, ids[:5], chunk, stop, args.rounds)
                rows.append({"model": model, "tokens": len(chunk), "stop": stop, **row})
    print(
        f"{'model':8} {'tokens':>6} {'stop':>13} {'one at a time us/tok':>21} {'whole us/tok':>13}"
    )
    for r in rows:
        print(
            f"{r['model']:8} {r['tokens']:6} {','.join(r['stop']) or '-':>13} "
            f"{r['one_at_a_time_us_per_token']:21.2f} {r['whole_chunk_us_per_token']:13.2f} "
            f"{r['ratio']:6.1f}x"
        )
    path = write_results(
        "detok.json",
        {"machine": machine(loadavg_before=loadavg), "settings": vars(args), "rows": rows},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
