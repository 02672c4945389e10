"""The gateway's detokenizer: a worker's chunk fed a token at a time (the gateway before
2026-12-05) against the whole chunk at once (``Detokenizer.feed`` without stop strings), per
tokenizer and chunk length. A chunk of n tokens is what a call that is not streamed gets in its
last message; a streamed call gets a chunk per ``stream_interval_s``.

Each variant decodes the same chunk after 5 prompt ids of context and ``finish``es, ``--rounds``
times, taking turns; the table gives the median microseconds per token and the ratio. The two
must give the same text (checked).

Usage: python -m bench.detok [--models tiny,smollm2] [--lengths 16,256] [--rounds 200]
(under a minute). Prints a table and writes bench/results/detok.json.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.machine import machine
from bench.output import write_results
from common.models import build_tiny_model, load_tokenizer, resolve_model
from rollout.gateway.detok import Detokenizer

TEXT = "The quick brown fox jumps over the lazy dog; héllo 日本. " * 40


def one_at_a_time(tok, context: list[int], chunk: list[int]) -> str:
    detok = Detokenizer(tok, context=context)
    return "".join(detok.feed([token_id]).text for token_id in chunk) + detok.finish()


def whole(tok, context: list[int], chunk: list[int]) -> str:
    detok = Detokenizer(tok, context=context)
    return detok.feed(chunk).text + detok.finish()


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
            context = ids[:5]
            for n in map(int, args.lengths.split(",")):
                chunk = ids[5 : 5 + n]
                if one_at_a_time(tok, context, chunk) != whole(tok, context, chunk):
                    raise SystemExit(f"{model}, {n} tokens: the two variants differ")
                times: dict[str, list[float]] = {"one at a time": [], "whole chunk": []}
                for _ in range(args.rounds):
                    for name, variant in (("one at a time", one_at_a_time), ("whole chunk", whole)):
                        start = time.perf_counter()
                        variant(tok, context, chunk)
                        times[name].append(time.perf_counter() - start)
                us = {k: statistics.median(v) / n * 1e6 for k, v in times.items()}
                rows.append(
                    {
                        "model": model,
                        "tokens": n,
                        "one_at_a_time_us_per_token": round(us["one at a time"], 2),
                        "whole_chunk_us_per_token": round(us["whole chunk"], 2),
                        "ratio": round(us["one at a time"] / us["whole chunk"], 1),
                    }
                )
    print(
        f"{'model':10} {'tokens':>6} {'one at a time us/tok':>21} {'whole us/tok':>13} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['model']:10} {r['tokens']:6} {r['one_at_a_time_us_per_token']:21.2f} "
            f"{r['whole_chunk_us_per_token']:13.2f} {r['ratio']:6.1f}"
        )
    path = write_results(
        "detok.json",
        {"machine": machine(loadavg_before=loadavg), "settings": vars(args), "rows": rows},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
