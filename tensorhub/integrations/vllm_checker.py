"""The baseline vLLM's ``/weight_checker`` compares against, for a TensorHub version.

``vllm serve`` (with ``VLLM_SERVER_DEV_MODE=1``) answers ``POST /weight_checker`` with
``{"action": "compare", "baseline": {key: sha256}}``: ``{"match": bool, "mismatches": [key, ...]}``,
where each worker's keys are ``dp<i>:pp<j>:pcp<k>:tp<r>:<parameter name>`` and each value is the
sha256 of that parameter's bytes **as the engine holds them**, after vLLM's weight processing
(``vllm/model_executor/model_loader/weight_checksum.py``). :func:`weight_checker_baseline` makes
that baseline for ``source_model`` version N and an engine layout, so that "does this engine hold
exactly version N?" is one HTTP call::

    baseline = weight_checker_baseline("actor", 7, "/models/qwen3-8b", engine_args={"dtype": "bfloat16"})
    requests.post(f"{url}/weight_checker", json={"action": "compare", "baseline": baseline}).json()
    # {"match": true, "mismatches": []}

How. For each worker of the layout (``tensor_parallel_size`` ranks) a child process builds the
engine's model as vLLM does (same config, same loader, placeholder weights), then loads version N
through the ``tensorhub`` backend exactly as an engine does (the loader trace, the converted
model's bytes pulled from whoever holds them, vLLM's layerwise reload and weight processing), and
hashes the parameters with vLLM's own digest function. The children join the converted model as
the replica ``replica`` while they pull, and leave. Nothing is computed from the engine being
checked.

vLLM's weight processing is platform-specific (on the CPU build a linear layer whose weights go
to oneDNN or the sgl kernel keeps an empty ``weight`` parameter, which the digest then cannot see;
quantization rewrites parameters), so compute the baseline with the same vLLM build on the same
kind of device as the engine.

Child processes (not this one): vLLM keeps its distributed state per process, and a trainer's
process has its own ``torch.distributed`` world.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from tensorhub.core.errors import InvalidArgument, TensorHubError

__all__ = ["BaselineFailed", "weight_checker_baseline", "weight_checker_baselines"]


class BaselineFailed(TensorHubError):
    """A child process computing a ``/weight_checker`` baseline failed (its output's tail says why)."""

    code = "weight_checker_baseline_failed"


def weight_checker_baselines(
    source_model: str,
    versions: Sequence[int],
    model_dir: str,
    *,
    engine_args: dict[str, Any] | None = None,
    init_info: dict[str, Any] | None = None,
    server: str | None = None,
    replica: str = "weight-checker",
    timeout: float = 600.0,
) -> dict[int, dict[str, str]]:
    """Per version, the ``baseline`` that ``/weight_checker``'s ``compare`` takes for an engine
    of this layout holding that TensorHub version of ``source_model``.

    Args:
        source_model: the model the trainer publishes (the engines' ``init_info`` ``source_model``).
        versions: TensorHub versions (integers; each must still be available from some holder).
        model_dir: the directory the engine serves (its ``config.json``: the architecture).
        engine_args: the engine's layout, as ``vllm.EngineArgs`` keywords (``dtype``,
            ``tensor_parallel_size``, ``quantization``, ...); they must equal the engine's.
        init_info: the engines' other ``init_info`` keys (``names``/``dtype_names``/``shapes``
            when the trainer's names differ from ``model_dir``'s checkpoint; ``model`` when the
            engines name their converted model; ``transports``).
        server: the reference server (None: ``init_info``'s, else ``$TENSORHUB_SERVER``).
        replica: the replica name the children use while they pull.
        timeout: seconds for the whole computation.

    Returns:
        ``{version: {"dp0:pp0:pcp0:tp<r>:<parameter>": sha256 hex}}``.

    Raises:
        InvalidArgument: a version that is not an integer >= 0, no versions, bad ``engine_args``.
        BaselineFailed: a child failed (the message carries its output's tail) or ran past ``timeout``.
    """
    vs = list(versions)
    if not vs or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in vs):
        raise InvalidArgument(f"weight_checker_baselines: versions are integers >= 0 (at least one), got {versions!r}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise InvalidArgument(f"weight_checker_baselines: {model_dir!r} has no config.json (the engine's model directory)")
    args = dict(engine_args or {})
    for key in ("pipeline_parallel_size", "data_parallel_size"):
        if int(args.get(key, 1)) != 1:
            raise InvalidArgument(f"weight_checker_baselines: {key}={args[key]} is not supported (tensor parallelism is)")
    tp = args.get("tensor_parallel_size", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise InvalidArgument(f"weight_checker_baselines: tensor_parallel_size must be an integer >= 1, got {tp!r}")
    info = {**(init_info or {}), "source_model": source_model, "replica": replica}
    if server is not None:
        info["server"] = server
    with socket.socket() as s:  # a free port for the children's process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="tensorhub-baseline-") as tmp:
        procs = []
        try:
            for rank in range(tp):
                spec: dict[str, Any] = {"rank": rank, "world": tp, "init_method": f"tcp://127.0.0.1:{port}", "model_dir": model_dir,
                        "engine_args": args, "init_info": info, "versions": vs, "out": os.path.join(tmp, f"{rank}.json")}  # fmt: skip
                log = open(os.path.join(tmp, f"{rank}.log"), "w+b")  # noqa: SIM115 - closed below
                procs.append((subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=log,
                                               stderr=subprocess.STDOUT, env={**os.environ, "VLLM_DIST_IDENT": str(port)}),
                              log, spec))  # fmt: skip
                assert procs[-1][0].stdin is not None
                procs[-1][0].stdin.write(json.dumps(spec).encode())
                procs[-1][0].stdin.close()
            failed = None
            for proc, log, spec in procs:
                try:
                    rc = proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    failed = f"rank {spec['rank']} ran past {timeout} s"
                    break
                if rc != 0:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-3000:]
                    failed = f"rank {spec['rank']} exited with {rc}:\n{tail}"
                    break
            if failed is not None:
                raise BaselineFailed(f"computing the /weight_checker baseline of {source_model!r} {vs}: {failed}")
            out: dict[int, dict[str, str]] = {v: {} for v in vs}
            for rank in range(tp):
                with open(os.path.join(tmp, f"{rank}.json")) as f:
                    got = json.load(f)
                for v in vs:
                    out[v].update(got[str(v)])
            return out
        finally:
            for proc, log, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
                log.close()


def weight_checker_baseline(source_model: str, version: int, model_dir: str, **kw: Any) -> dict[str, str]:
    """:func:`weight_checker_baselines` for one version."""
    return weight_checker_baselines(source_model, [version], model_dir, **kw)[version]


def _child(spec: dict[str, Any]) -> None:
    """One worker of the layout: build the model as vLLM does, load each version through the
    tensorhub backend, hash the parameters as vLLM's weight checker does."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import get_pcp_group, get_pp_group, get_tp_group
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    from tensorhub.integrations.vllm_backend import TensorHubUpdateInfo, TensorHubWeightTransferEngine

    args = {"skip_tokenizer_init": True, "enforce_eager": True, **spec["engine_args"]}
    args.update(model=spec["model_dir"], load_format="dummy", weight_transfer_config={"backend": "tensorhub"})
    vllm_config = EngineArgs(**args).create_engine_config()
    rank = spec["rank"]
    if current_platform.device_type == "cpu":
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

        _set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does before loading
        device = torch.device("cpu")
    else:
        device = torch.device(current_platform.device_type, rank)
        current_platform.set_device(device)
    with set_current_vllm_config(vllm_config):
        init_worker_distributed_environment(vllm_config, rank, spec["init_method"], rank, current_platform.dist_backend)
        with torch.device(device):
            model = get_model(vllm_config=vllm_config)
        prefix = (f"dp{vllm_config.parallel_config.data_parallel_index}:pp{get_pp_group().rank_in_group}:"
                  f"pcp{get_pcp_group().rank_in_group}:tp{get_tp_group().rank_in_group}:")  # fmt: skip
        backend = TensorHubWeightTransferEngine(vllm_config.weight_transfer_config, vllm_config, device, model)
        backend.init_transfer_engine(backend.parse_init_info(spec["init_info"]))
        out: dict[str, dict[str, str]] = {}
        try:
            for v in spec["versions"]:
                backend.receive_weights(TensorHubUpdateInfo(version=v))
                out[str(v)] = {prefix + n: d for n, d in compute_tensor_digests(model).items()}
        finally:
            backend.shutdown()
    with open(spec["out"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    _child(json.loads(sys.stdin.read()))
    sys.stdout.flush()
    os._exit(0)  # vLLM's process groups and threads: nothing left to tear down gracefully
