"""Benchmarks of the pure core, one section per function; `main()` runs them and prints a table (or JSON).

Outer step: our Nesterov against `torch.optim.SGD(nesterov=True).step()` on the same vectors (the limit).

Codecs: for a float32 vector of `--numel` elements, time a plain `dst.copy_(src)` (the limit: the least any
codec must do is read the input and write an output) and, per codec, `encode` plus a streaming decode fed
1 MiB chunks into a preallocated buffer (as a receiver decodes into its accumulation buffer). Figures are the
best of `--repeats` runs, on one torch thread as in the suite; GB/s counts the fp32 input bytes.

    python -m diloco.bench.bench_core --numel 100000000 [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from diloco.bench.section import Context, Log, console_table, standalone, table
from diloco.core import parallel
from diloco.core.broadcast import (
    DEFAULT_BROADCAST_CODEC,
    BroadcastFollower,
    BroadcastShadow,
    Refusal,
    params_checksum,
)
from diloco.core.codecs import CODEC_NAMES, Codec, Int4Codec, Int8Codec, get_codec, iter_chunks
from diloco.core.outer import Nesterov

CHUNK_BYTES = 1 << 20


def _best_of(repeats: int, fn: Callable[[], object]) -> float:
    """Best wall time of `repeats` calls, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _row(name: str, numel: int, total_s: float, copy_s: float, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "numel": numel,
        "total_s": total_s,
        "gb_per_s": 4 * numel / total_s / 1e9,
        "x_copy": total_s / copy_s,
        **extra,
    }


def _stream_decode(codec: Codec, data: bytes | bytearray | memoryview, meta: Any, out: torch.Tensor) -> torch.Tensor:
    decoder = codec.decoder(meta, out)
    for chunk in iter_chunks(data, CHUNK_BYTES):
        decoder.feed(chunk)
    return decoder.finish()


def bench_codecs(
    numel: int,
    repeats: int = 3,
    *,
    block_size: int = 128,
    topk_fraction: float = 0.01,
    codecs: Sequence[str] = CODEC_NAMES,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Time copy, clone and each codec's encode + streaming decode on `numel` float32 values."""
    src = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once, so the copy measures memory bandwidth only
    copy_s = _best_of(repeats, lambda: dst.copy_(src))
    rows = [_row("copy_ (limit)", numel, copy_s, copy_s, encode_s=None, decode_s=None)]
    clone_s = _best_of(repeats, src.clone)
    rows.append(_row("clone (fresh memory)", numel, clone_s, copy_s, encode_s=None, decode_s=None))
    out = torch.empty_like(src)
    out.zero_()
    for name in codecs:
        # the settings are int8/int4's and topk's; sparse runs with its own defaults (4096-element chunks, 1/64)
        codec = get_codec(
            name,
            block_size=block_size if name in ("int8", "int4") else None,
            topk_fraction=topk_fraction if name == "topk" else None,
        )
        encode_s = decode_s = total_s = float("inf")
        data, meta = codec.encode(src)
        for _ in range(repeats):
            del data
            gc.collect()
            t0 = time.perf_counter()
            data, meta = codec.encode(src)
            t1 = time.perf_counter()
            _stream_decode(codec, data, meta, out)
            t2 = time.perf_counter()
            encode_s, decode_s = min(encode_s, t1 - t0), min(decode_s, t2 - t1)
            total_s = min(total_s, t2 - t0)
        err = (out - src).abs_()
        rows.append(
            _row(
                name,
                numel,
                total_s,
                copy_s,
                encode_s=encode_s,
                decode_s=decode_s,
                encoded_bytes=meta.encoded_bytes,
                compression=4 * numel / meta.encoded_bytes,
                max_abs_err=float(err.max()),
                rms_err=float(err.square_().mean().sqrt()),
            )
        )
        del data, err
    return rows


def bench_broadcast(
    numel: int, repeats: int = 3, codec: str = DEFAULT_BROADCAST_CODEC, seed: int = 0, threads: int = 1
) -> dict[str, Any]:
    """The broadcast path of one version (ALGORITHM.md section 10), as the services run it: the coordinator's
    `BroadcastShadow.advance` (encode `Θ − Θ̂` once, `Θ̂ += D(q)`, the checksum of `Θ̂` moved: fused slab by slab,
    scratch lent as the merge buffer is) and one learner applying it (`HeldParams.at`: the payload, queued encoded,
    decoded window by window and added to its `Θ̂` in place, its checksum moved in the same loop), against a `copy_`
    of the vector. `floor_x`: the bytes the two sides must move (encode: read Θ and Θ̂, write Θ̂ and the payload;
    apply: read the payload and Θ̂, write Θ̂) over the bytes `copy_` moves, the ratio at `copy_`'s speed.
    `checksum_s`: the state checksum of the whole vector alone (what a fresh learner pays once for its version 0).
    `threads`: every pass, the copy included, on that many threads (`diloco.core.parallel.set_threads`, a service's
    `--threads`); 1 afterwards."""
    parallel.set_threads(threads)
    try:
        return _bench_broadcast(numel, repeats, codec, seed) | {"threads": threads}
    finally:
        parallel.set_threads(1)


def _bench_broadcast(numel: int, repeats: int, codec: str, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(numel, generator=gen)
    dst = torch.empty_like(theta)
    dst.copy_(theta)
    copy_s = _best_of(repeats, lambda: dst.copy_(theta))
    checksum_s = _best_of(repeats, lambda: params_checksum(theta))
    scratch = torch.empty_like(theta)
    scratch.zero_()
    encode_s = apply_s = float("inf")
    payload = 0
    for v in range(1, repeats + 2):
        shadow = BroadcastShadow(theta, 0, codec)
        follower = BroadcastFollower()
        follower.snapshot(0, shadow.shadow.clone())
        theta_v = theta + 1e-3 * v
        gc.collect()
        t0 = time.perf_counter()
        delta = shadow.advance(theta_v, 1, scratch=scratch)
        t1 = time.perf_counter()
        assert delta is not None
        payload = delta.meta.encoded_bytes
        held = follower.delta(1, 0, delta.meta, delta.data, delta.checksum)
        assert not isinstance(held, Refusal)
        got = held.at(1)
        t2 = time.perf_counter()
        assert not isinstance(got, Refusal)
        if v > 1:  # the first is a warm-up: fresh memory everywhere
            encode_s, apply_s = min(encode_s, t1 - t0), min(apply_s, t2 - t1)
        del shadow, follower, delta, held, got, theta_v
    total = encode_s + apply_s
    return {
        "codec": codec,
        "numel": numel,
        "encode_s": encode_s,
        "apply_s": apply_s,
        "total_s": total,
        "copy_s": copy_s,
        "checksum_s": checksum_s,
        "floor_x": (20 * numel + 2 * payload) / (8 * numel),
        "x_copy": total / copy_s,
    }


KERNEL_SLICE = 1 << 16  # values: 256 KiB per float32 vector, the kernels' inputs together inside a core's L2 cache


def bench_broadcast_kernels(
    numel: int, repeats: int = 3, codec: str = DEFAULT_BROADCAST_CODEC, slice_values: int = KERNEL_SLICE
) -> dict[str, Any]:
    """Whether the broadcast's fused loops wait on memory or on arithmetic, on one thread: the coordinator's
    `kernels.quantize_toward` (Θ − Θ̂ into the payload, Θ̂ moved, its checksum terms) and a learner's
    `kernels.dequantize_add` (the payload added to its Θ̂, its terms), first over the whole vector (`memory`), then
    over a slice small enough to stay in cache, called until as many values went through (`cache`; one call per
    slice, a few microseconds each). What the slice saves is the memory traffic's share of the kernels' time."""
    from diloco.core import kernels  # numba: only when this runs

    c = get_codec(codec)
    if not isinstance(c, Int4Codec | Int8Codec):
        raise ValueError(f"{codec} has no fused broadcast kernels (int8 and int4 have)")
    bs, qmax = c.block_size, c.qmax
    n = numel // bs * bs
    part = max(bs, min(slice_values, n) // bs * bs)
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(n, generator=gen).numpy()
    shadow, held = (theta + 1e-3).copy(), theta.copy()
    _, scales, packed = c._payload(n)  # the codec's own layout: its scales and packed values

    def encode(m: int, times: int) -> None:
        for _ in range(times):
            kernels.quantize_toward(theta[:m], shadow[:m], shadow[:m], bs, qmax, scales, packed, 0, False)

    def apply(m: int, times: int) -> None:
        for _ in range(times):
            kernels.dequantize_add(packed, scales, bs, qmax, held[:m], 0, False)

    encode(part, 1)  # compiled (or loaded from numba's cache) before any timing
    apply(part, 1)
    times = n // part
    return {
        "codec": codec,
        "numel": n,
        "slice_values": part,
        "encode_memory_s": _best_of(repeats, lambda: encode(n, 1)),
        "apply_memory_s": _best_of(repeats, lambda: apply(n, 1)),
        "encode_cache_s": _best_of(repeats, lambda: encode(part, times)) * n / (part * times),
        "apply_cache_s": _best_of(repeats, lambda: apply(part, times)) * n / (part * times),
    }


def bench_outer(numel: int, repeats: int = 3, steps: int = 3) -> list[dict[str, Any]]:
    """Our Nesterov outer step against its limit, `torch.optim.SGD(nesterov=True).step()`, on the same inputs.

    Each timed call runs `steps` outer steps (the first one allocates the momentum buffer in both)."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=gen)
    delta = torch.randn(numel, generator=gen)

    def torch_sgd() -> None:
        p = torch.nn.Parameter(start.clone())
        opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
        p.grad = delta
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step()
        timings.append(time.perf_counter() - t0)

    def ours() -> None:
        p = start.clone()
        opt = Nesterov(0.7, 0.9)
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step(p, delta)
        timings.append(time.perf_counter() - t0)

    timings: list[float] = []
    best = {"torch SGD(nesterov) step": float("inf"), "diloco Nesterov step": float("inf")}
    for _ in range(repeats):  # interleaved, so both see the same machine load
        for name, fn in (("torch SGD(nesterov) step", torch_sgd), ("diloco Nesterov step", ours)):
            gc.collect()
            fn()
            best[name] = min(best[name], timings.pop() / steps)
    results = best
    limit = results["torch SGD(nesterov) step"]
    return [
        {"name": name, "numel": numel, "total_s": t, "gb_per_s": 4 * numel / t / 1e9, "x_limit": t / limit}
        for name, t in results.items()
    ]


COLUMNS = (
    ("name", "{}"),
    ("encode_s", "{:.3f}"),
    ("decode_s", "{:.3f}"),
    ("total_s", "{:.3f}"),
    ("gb_per_s", "{:.2f}"),
    ("x_copy", "{:.1f}"),
    ("x_limit", "{:.2f}"),
    ("compression", "{:.2f}"),
    ("max_abs_err", "{:.3g}"),
)


def _table(title: str, rows: list[dict[str, Any]], caption: str) -> str:
    cells = [[fmt.format(r[key]) if r.get(key) is not None else "-" for key, fmt in COLUMNS] for r in rows]
    return console_table(title, [key for key, _ in COLUMNS], cells, caption)


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=3, help="best of N")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--topk-fraction", type=float, default=0.01)
    parser.add_argument("--codecs", default=",".join(CODEC_NAMES), help="comma-separated subset")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: codecs,outer")


def _run(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    """The module on its own: the codecs and the outer step as the flags say."""
    skip = set(args.skip.split(","))
    codec_rows = (
        []
        if "codecs" in skip
        else bench_codecs(
            args.numel,
            args.repeats,
            block_size=args.block_size,
            topk_fraction=args.topk_fraction,
            codecs=[c for c in args.codecs.split(",") if c],
        )
    )
    outer_rows = [] if "outer" in skip else bench_outer(args.numel, args.repeats)
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    return {"env": env, "numel": args.numel, "repeats": args.repeats, "codecs": codec_rows, "outer": outer_rows}


def _tables(r: dict[str, Any]) -> str:
    caption = ", ".join(f"{k} {v}" for k, v in r["env"].items())
    n, repeats = r["numel"], r["repeats"]
    tables = []
    if r["codecs"]:
        title = f"codecs: encode + streaming decode (1 MiB chunks) of {n:,} float32, best of {repeats}"
        tables.append(_table(title, r["codecs"], caption))
    if r["outer"]:
        tables.append(_table(f"outer step on {n:,} parameters, best of {repeats}", r["outer"], caption))
    return "\n".join(tables)


def main(argv: Sequence[str] | None = None) -> int:
    return standalone(__doc__, _flags, _run, _tables, argv)


# --- the suite's `core` section ---------------------------------------------------------------------------------
OUTER_TARGET_X = 1.2  # our outer step against torch's SGD(nesterov=True) on the same vectors
INT8_TARGET_X_COPY = 3.0  # int8 encode + streaming decode against a copy into a preallocated buffer (issue #13)
BROADCAST_TARGET_X_COPY = 3.0  # one version's broadcast: encoded once + applied by a learner, against a copy
BROADCAST_THREADS = 2  # the broadcast again with `--threads` this many (this machine's cores)


@dataclass(frozen=True)
class CoreSettings:
    numel: int = 100_000_000
    repeats: int = 3
    block_size: int = 128
    topk_fraction: float = 0.01


FULL = CoreSettings()
QUICK = CoreSettings(numel=1_000_000, repeats=1)


def section(ctx: Context) -> dict[str, Any]:
    s = QUICK if ctx.quick else FULL
    ctx.log(f"  codecs and the outer step on {s.numel:,} float32, best of {s.repeats}")
    codec_rows = bench_codecs(s.numel, s.repeats, block_size=s.block_size, topk_fraction=s.topk_fraction)
    outer_rows = bench_outer(s.numel, s.repeats)
    broadcast = bench_broadcast(s.numel, s.repeats)
    broadcast_threads = bench_broadcast(s.numel, s.repeats, threads=BROADCAST_THREADS)
    broadcast_kernels = bench_broadcast_kernels(s.numel, s.repeats)
    by = {r["name"]: r for r in [*codec_rows, *outer_rows]}
    outer_x = by["diloco Nesterov step"]["x_limit"]
    int8_x = by["int8"]["x_copy"]
    checks = [
        {
            "name": "Nesterov outer step vs `torch.optim.SGD(nesterov=True).step()`",
            "target": f"<= {OUTER_TARGET_X:g}x",
            "measured": f"{outer_x:.2f}x",
            "pass": outer_x <= OUTER_TARGET_X,
        },
        {
            "name": "int8 encode + streaming decode vs a copy into a preallocated buffer",
            "target": f"<= {INT8_TARGET_X_COPY:g}x",
            "measured": f"{int8_x:.1f}x",
            "pass": int8_x <= INT8_TARGET_X_COPY,
        },
        {
            "name": f"{broadcast['codec']} broadcast of a version (encoded once, applied by a learner) vs a copy",
            "target": f"<= {BROADCAST_TARGET_X_COPY:g}x",
            "measured": f"{broadcast['x_copy']:.1f}x ({broadcast['encode_s']:.3f} s + {broadcast['apply_s']:.3f} s "
            f"vs {broadcast['copy_s']:.3f} s{_crc_share(broadcast)})",
            "pass": broadcast["x_copy"] <= BROADCAST_TARGET_X_COPY,
        },
    ]
    return {
        "settings": asdict(s),
        "codecs": codec_rows,
        "outer": outer_rows,
        "broadcast": broadcast,
        "broadcast_threads": broadcast_threads,
        "broadcast_kernels": broadcast_kernels,
        "checks": checks,
    }


def summary(r: dict[str, Any]) -> str:
    """The headline table (the repository README shows it)."""
    by = {row["name"]: row for row in [*r["codecs"], *r["outer"]]}
    ours, sgd = by["diloco Nesterov step"], by["torch SGD(nesterov) step"]
    int8, clone, copy = by["int8"], by["clone (fresh memory)"], by["copy_ (limit)"]
    return table(
        ["operation", "time", "ratio to its limit"],
        [
            [
                "our Nesterov outer step vs `torch.optim.SGD(nesterov=True).step()`",
                f"{ours['total_s']:.3f} s vs {sgd['total_s']:.3f} s",
                f"{ours['x_limit']:.2f}x (target ≤ {OUTER_TARGET_X:g}x)",
            ],
            [
                "int8 encode + streaming decode (with crc32) vs a copy into fresh memory "
                f"(`clone`, {clone['gb_per_s']:.1f} GB/s)",
                f"{int8['total_s']:.3f} s vs {clone['total_s']:.3f} s",
                f"{int8['total_s'] / clone['total_s']:.1f}x",
            ],
            [
                f"the same vs a copy into a preallocated buffer (`copy_`, {copy['gb_per_s']:.1f} GB/s)",
                f"{int8['total_s']:.3f} s vs {copy['total_s']:.3f} s",
                f"{int8['x_copy']:.1f}x (target ≤ {INT8_TARGET_X_COPY:g}x)",
            ],
            *_broadcast_row(r.get("broadcast")),
            *_threads_row(r.get("broadcast"), r.get("broadcast_threads")),
            *_kernels_row(r.get("broadcast_kernels")),
        ],
    )


def _crc_share(b: dict[str, Any]) -> str:
    """The broadcast's floor, or (results from before the fused checksum) what the crc32 of Θ̂ took on each side."""
    if "floor_x" in b:
        return f"; the bytes it must move at `copy_`'s speed: {b['floor_x']:.2f}x"
    if "crc_s" not in b:
        return ""
    return f"; of it, the crc32 of Θ̂ on each side: 2 x {b['crc_s']:.3f} s = {2 * b['crc_s'] / b['copy_s']:.1f}x"


def _broadcast_row(b: dict[str, Any] | None) -> list[list[str]]:
    if not b:
        return []  # measured before the broadcast row existed
    return [
        [
            f"{b['codec']} broadcast of a version: encoded once (`BroadcastShadow.advance`) + applied by a learner "
            "(decoded window by window into its Θ̂, checksummed) vs `copy_`",
            f"{b['encode_s']:.3f} s + {b['apply_s']:.3f} s vs {b['copy_s']:.3f} s{_crc_share(b)}",
            f"{b['x_copy']:.1f}x (target ≤ {BROADCAST_TARGET_X_COPY:g}x)",
        ]
    ]


def _threads_row(one: dict[str, Any] | None, more: dict[str, Any] | None) -> list[list[str]]:
    """The same broadcast with `--threads` N: each pass against its own time on one thread."""
    if not one or not more:
        return []  # measured before the row existed
    n = more["threads"]
    return [
        [
            f"the same on {n} threads (`--threads {n}`: encode, apply and the copy), against one thread",
            f"{more['encode_s']:.3f} s + {more['apply_s']:.3f} s vs {more['copy_s']:.3f} s",
            f"encode {one['encode_s'] / more['encode_s']:.2f}x, apply {one['apply_s'] / more['apply_s']:.2f}x, "
            f"copy {one['copy_s'] / more['copy_s']:.2f}x faster; {more['x_copy']:.1f}x its copy",
        ]
    ]


def _kernels_row(k: dict[str, Any] | None) -> list[list[str]]:
    """The broadcast's fused loops alone, over the vector in memory and over a slice in cache."""
    if not k:
        return []  # measured before the row existed
    memory = k["encode_memory_s"] + k["apply_memory_s"]
    cache = k["encode_cache_s"] + k["apply_cache_s"]
    return [
        [
            f"its two fused loops alone ({k['codec']}, one thread: `quantize_toward` + `dequantize_add`), over the "
            f"vector in memory vs a {4 * k['slice_values'] // 1024} KiB slice in cache, called until as many values "
            "went through",
            f"{k['encode_memory_s']:.3f} s + {k['apply_memory_s']:.3f} s vs "
            f"{k['encode_cache_s']:.3f} s + {k['apply_cache_s']:.3f} s",
            f"memory's share of their time: {max(0.0, 1 - cache / memory):.0%}",
        ]
    ]


def markdown(r: dict[str, Any]) -> str:
    s = r["settings"]
    codec_rows = [
        [
            row["name"],
            f"{row['encode_s']:.3f}",
            f"{row['decode_s']:.3f}",
            f"{row['total_s']:.3f}",
            f"{row['x_copy']:.1f}x",
            f"{row['compression']:.1f}x",
            f"{row['max_abs_err']:.3g}",
        ]
        for row in r["codecs"]
        if row.get("encode_s") is not None
    ]
    return "\n\n".join(
        [
            f"Command: `python -m diloco.bench.bench_core --numel {s['numel']} --repeats {s['repeats']}`. A float32 "
            f"vector of {s['numel']:,} elements; best of {s['repeats']}. The outer step runs the same arithmetic as "
            "torch's SGD (the tests check the results are bit-for-bit equal). A codec's time is `encode` plus a "
            "streaming decode fed 1 MiB chunks into a preallocated buffer (as a learner decodes a snapshot; the "
            "coordinator's upload path and a learner's delta decode window by window instead); int8 and int4 "
            f"quantize in blocks of {s['block_size']}, topk keeps "
            f"{s['topk_fraction']:.0%} of the entries, sparse 64 of every 4096 with 2-bit values.",
            summary(r),
            table(
                ["codec", "encode (s)", "decode (s)", "total (s)", "x `copy_`", "compression", "max abs error"],
                codec_rows,
            ),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
