"""`ds4f synth`, `ds4f convert`, `ds4f verify`: make, convert and check checkpoints."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from ds4f.api import Ds4fError
from ds4f.cli.options import add_force, add_geometry, add_seed, geometry_name
from ds4f.cli.output import check_output_dir, command_inputs, disk_size


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file())


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    if name == "synth":
        from ds4f.api import CONFIG_KEYS, Geometry

        parser.add_argument("out", type=Path, help="output directory (created; must not exist unless --force)")
        add_geometry(parser, "tiny")
        add_seed(parser, 0)
        parser.add_argument("--shard-mib", type=float, default=512, help="maximum shard size in MiB (default 512)")
        add_force(parser, "OUT", replaces="a checkpoint directory (either form)")
        parser.add_argument("--mtp", action="store_true",
                            help="also write the MTP layer (mtp.0.*), the draft of speculative decoding")
        grp = parser.add_argument_group("geometry overrides")
        for f in dataclasses.fields(Geometry):
            typ = float if f.type in ("float", float) else int
            grp.add_argument(f"--{f.name.replace('_', '-')}", dest=f"g_{f.name}", type=typ, default=None,
                             metavar=typ.__name__.upper(), help=f"config.json {CONFIG_KEYS[f.name]}")
    elif name == "convert":
        parser.add_argument("src", type=Path, help="official checkpoint directory (safetensors shards + index)")
        parser.add_argument("dst", type=Path, help="output directory for the ds4f layout")
        add_force(parser, "DST", replaces="a ds4f layout directory (pool-mxfp4.json in it) not holding SRC")
    elif name == "verify":
        parser.add_argument("path", type=Path, help="checkpoint directory (either form)")
    else:  # pragma: no cover - the registry only maps these three names here
        raise ValueError(name)


def run(args: argparse.Namespace) -> int:
    return {"synth": _synth, "convert": _convert, "verify": _verify}[args.command](args)


def _synth(args) -> int:
    from ds4f.api import Geometry, get_geometry, synth_checkpoint

    base = get_geometry(geometry_name(args))
    overrides = {f.name: getattr(args, f"g_{f.name}") for f in dataclasses.fields(Geometry)
                 if getattr(args, f"g_{f.name}") is not None}
    try:
        g = base.replace(**overrides) if overrides else base
    except Ds4fError as exc:
        raise Ds4fError(f"--geometry {args.geometry} with overrides: {str(exc).removeprefix('geometry: ')}") from None
    if args.shard_mib <= 0:
        raise Ds4fError(f"--shard-mib must be positive, got {args.shard_mib}")
    check_output_dir(args.out, "OUT", command_inputs(known_checkpoints=False))
    if args.force:
        _check_replaceable(args.out)
    t0 = time.perf_counter()
    out = synth_checkpoint(args.out, g, seed=args.seed, progress=True, shard_bytes=int(args.shard_mib * 2 ** 20),
                           force=args.force, mtp=args.mtp)
    dt = time.perf_counter() - t0
    print(f"wrote {out} ({args.geometry}{' + overrides' if overrides else ''}, seed {args.seed}):"
          f" {disk_size(_dir_size(out))} in {dt:.1f} s; {g.n_layers} layers x {g.n_experts} experts of"
          f" {_mib(g.expert_nbytes)}{' + the MTP layer' if args.mtp else ''}")
    return 0


def _check_replaceable(out: Path) -> None:
    """synth --force replaces only a checkpoint (either form) or an empty directory."""
    from ds4f.api import detect_kind

    if not (out.exists() or out.is_symlink()):
        return
    if out.is_dir() and not any(out.iterdir()):
        return
    try:
        if not out.is_dir():
            raise Ds4fError("not a directory")
        detect_kind(out)
    except Ds4fError:
        raise Ds4fError(f"{out}: --force replaces only a checkpoint directory; this is not one, "
                        f"so it is left as it is") from None


def _convert(args) -> int:
    from ds4f.api import convert_checkpoint

    src = args.src if args.src.is_dir() else args.src.parent   # SRC may name a file of the checkpoint
    # DST is never the source, inside it, nor a directory holding it or another input (the config
    # in use, the run history, the prefix cache's directory), even with --force
    check_output_dir(args.dst, "DST", command_inputs(known_checkpoints=False,
                                                     extra=[("the source checkpoint", src)]))
    t0 = time.perf_counter()
    out = convert_checkpoint(args.src, args.dst, progress=True, force=args.force)
    dt = time.perf_counter() - t0
    print(f"wrote {out} (ds4f layout): {disk_size(_dir_size(out))} from {disk_size(_dir_size(src))} of "
          f"official shards in {dt:.1f} s")
    return 0


def _verify(args) -> int:
    from ds4f.api import verify_checkpoint

    t0 = time.perf_counter()
    info: dict = {}
    problems = verify_checkpoint(args.path, progress=True, info=info)
    dt = time.perf_counter() - t0
    if problems:
        for p in problems:
            print(f"problem: {p}", file=sys.stderr)
        print(f"{args.path}: {len(problems)} problem{'s' if len(problems) != 1 else ''}", file=sys.stderr)
        return 1
    g = info.get("geometry")
    mtp = " + the MTP layer" if info.get("mtp_layers") else ""
    print(f"{info['path']}: OK ({info['kind']}; {g.n_layers} layers{mtp} x {g.n_experts} experts;"
          f" {info.get('records_checked', 0)} records, {disk_size(info.get('bytes_checked', 0))} checked;"
          f" {info.get('nan_scale_bytes', 0)} NaN scale bytes; {info.get('tokenizer', 'no tokenizer')}) in {dt:.1f} s")
    return 0
