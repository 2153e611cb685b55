"""``tensorhub export`` and ``tensorhub import``: anchors and deltas as files (TRL's format).

``export`` writes a checkpoint as an **anchor** file of a version, or, given ``--base``, the
**delta** that takes the base to it (only the elements whose bytes changed). ``import`` replays
files into a checkpoint: an anchor (or ``--base``) then deltas, in order, each refused unless it
applies to what the previous one made, the result verified against the last file's checksums,
and written as an anchor. Checkpoints are safetensors state dicts (an anchor file, a plain
``model.safetensors``, or a directory of them); delta files may come from TensorHub or from
anything else that writes TRL's format. See :mod:`tensorhub.runtime.deltafiles`.
"""

from __future__ import annotations

import argparse
from typing import Any

from tensorhub.core.errors import BaseMismatch, InvalidArgument

__all__ = ["add_parsers", "export_files", "import_files"]


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def export_files(args: argparse.Namespace) -> int:
    from tensorhub.runtime.deltafiles import read_checkpoint, write_anchor, write_delta
    from tensorhub.runtime.deltas import compute_delta, describe

    target = read_checkpoint(args.target)
    version = args.version if args.version is not None else target.version
    if version is None:
        raise InvalidArgument(f"{args.target} does not say its version: give --version")
    if args.base is None:
        write_anchor(args.out, target.tensors, version=version, layout=target.layout, checksums=target.checksums)
        print(
            f"anchor of version {version}: {len(target.tensors)} tensors, {_mb(target.layout.total_bytes)} -> {args.out}"
        )
        return 0
    base = read_checkpoint(args.base)
    base_version = args.base_version if args.base_version is not None else base.version
    if base_version is None:
        raise InvalidArgument(f"{args.base} does not say its version: give --base-version")
    delta = compute_delta(base.tensors, target.tensors, base_version=base_version, version=version,
                          layout=target.layout, base_checksums=base.checksums, checksums=target.checksums)  # fmt: skip
    size = write_delta(args.out, delta)
    d = describe(delta)
    ratio = d["full_bytes"] / size if size else float("inf")
    print(f"delta {base_version} -> {version}: {d['changed_elements']} of {d['total_elements']} elements changed "
          f"(sparsity {d['sparsity']:.5f}) in {d['changed_tensors']} of {d['tensors']} tensors ({d['sparse']} sparse, "
          f"{d['dense']} dense); file {_mb(size)} for {_mb(d['full_bytes'])} of weights ({ratio:.1f}x) -> {args.out}")  # fmt: skip
    return 0


def import_files(args: argparse.Namespace) -> int:
    from tensorhub.runtime.deltafiles import Anchor, read, read_checkpoint, write_anchor
    from tensorhub.runtime.deltas import apply_chain

    files = list(args.files)
    held = None
    chain: list[Any] = []  # Delta
    if args.base is not None:
        start = read_checkpoint(args.base)
        held = start.checksums
    else:
        first = read(files.pop(0))
        if not isinstance(first, Anchor):
            raise InvalidArgument(f"{args.files[0]}: a delta; start from an anchor file, or give --base")
        start = first
        chain.append(first.as_delta())
    tensors = start.tensors
    for path in files:
        got = read(path, layout=start.layout)
        if isinstance(got, Anchor):
            raise InvalidArgument(f"{path}: an anchor after the first file; give deltas only")
        chain.append(got)
    if not chain:
        raise InvalidArgument("nothing to import: give an anchor or deltas")
    if args.base is not None and None not in (start.version, chain[0].base) and start.version != chain[0].base:
        raise BaseMismatch(f"{args.base} is version {start.version}; the first delta applies to {chain[0].base}")
    apply_chain(tensors, chain, held_checksums=held)
    last = chain[-1]
    checked = "verified against its checksums" if last.checksums is not None else "no checksums to verify against"
    write_anchor(args.out, tensors, version=last.version, layout=start.layout, checksums=last.checksums)
    print(f"version {last.version}: {len(chain)} file(s) applied, {checked} -> {args.out}")
    return 0


def add_parsers(sub: Any) -> None:
    """The ``export`` and ``import`` subcommands (``sub``: the parser's subparsers; nothing here
    imports torch until a subcommand runs)."""
    ex = sub.add_parser("export", help="a checkpoint as an anchor file, or the delta from --base to it (TRL's format)")
    ex.add_argument("target", help="the checkpoint (a safetensors state dict or anchor file, or a directory of them)")
    ex.add_argument("--out", "-o", required=True, help="the file to write")
    ex.add_argument(
        "--version", type=int, default=None, help="the target's version (default: its file's model_version)"
    )
    ex.add_argument("--base", default=None, help="write the delta from this checkpoint instead of an anchor")
    ex.add_argument(
        "--base-version", type=int, default=None, help="the base's version (default: its file's model_version)"
    )
    ex.set_defaults(func=export_files)

    im = sub.add_parser("import", help="replay an anchor (or --base) and deltas into a verified checkpoint")
    im.add_argument("files", nargs="+", help="an anchor file then delta files, in order (only deltas with --base)")
    im.add_argument("--out", "-o", required=True, help="the checkpoint to write (an anchor file of the last version)")
    im.add_argument("--base", default=None, help="start from this checkpoint instead of an anchor file")
    im.set_defaults(func=import_files)
