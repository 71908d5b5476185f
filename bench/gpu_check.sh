#!/usr/bin/env bash
# eqx_gpt on a GPU in one call (docs/PERFORMANCE.md, "On a GPU"): installs the wheels carried in
# .gpu-wheels/ (no network), then runs bench/gpu_check.py, which prints one summary table and
# writes it with every figure to OUT/gpu_check.json.
#
#   bash bench/gpu_check.sh --out "$OUT"                   # on a GPU, with .gpu-wheels carried
#   JAX_PLATFORMS=cpu bash bench/gpu_check.sh --dry-run    # tiny sizes on the CPU: every stage
#
# Options: --wheels DIR (default .gpu-wheels: the wheels it holds are installed, and its
# tiktoken-cache/ is GPT-2's BPE files; nothing is installed where it is absent), --out DIR,
# --dry-run, --budget S, --stages NAME..., --commit SHA (the rest go to bench/gpu_check.py).
# Python: $PYTHON, else the repo's .venv, else python3 (the GPU image's, with JAX and CUDA).
set -uo pipefail
cd "$(dirname "$0")/.."

wheels=.gpu-wheels
out=${OUT:-out/gpu-check}
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) wheels=${2:?--wheels needs a folder}; shift 2 ;;
    --out) out=${2:?--out needs a folder}; args+=(--out "$2"); shift 2 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done

if [[ -n "${PYTHON:-}" ]]; then py=$PYTHON
elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python
else py=python3
fi

# beartype is the one dependency the GPU image lacks; its version is uv.lock's.
beartype=$(awk '/^name = "beartype"$/ {getline; gsub(/[^0-9.]/, ""); print; exit}' uv.lock 2>/dev/null)
prepare="python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d $wheels beartype==${beartype:-0.23.1}"
installed=""
shopt -s nullglob
found=("$wheels"/*.whl)
if [[ ${#found[@]} -gt 0 ]]; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site-XXXXXX")
  if "$py" -m pip --version >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${found[@]}"
  elif command -v uv >/dev/null 2>&1; then  # a uv-made .venv has no pip
    uv pip install -q --python "$py" --no-index --no-deps --target "$site" "${found[@]}"
  else
    false
  fi || { echo "gpu_check: could not install the wheels in $wheels into $site" >&2; exit 2; }
  trap 'rm -rf "$site"' EXIT
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  installed="${found[*]##*/}"
  echo "gpu_check: installed ${#found[@]} wheel(s) from $wheels: $installed"
  packages=$(cd "$site" && for d in */; do [[ $d == *.dist-info/ || $d == bin/ ]] || echo "${d%/}"; done)
  # shellcheck disable=SC2086 (one argument per package)
  "$py" -c 'import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]; print(*sys.argv[1:])' \
    $packages | sed 's/^/gpu_check: importable from the wheels: /'
else
  echo "gpu_check: no wheels in $wheels/ (none installed). Where a package is missing (beartype on the GPU image):"
  echo "  $prepare"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
# GPT-2's BPE files, for the tests that read them (without them they skip; there is no network).
# The carried ones win: the GPU image sets TIKTOKEN_CACHE_DIR to a folder without them.
if [[ -d "$wheels/tiktoken-cache" ]]; then
  echo "gpu_check: GPT-2's BPE files from $wheels/tiktoken-cache${TIKTOKEN_CACHE_DIR:+ (not $TIKTOKEN_CACHE_DIR)}"
  TIKTOKEN_CACHE_DIR=$(cd "$wheels/tiktoken-cache" && pwd)
  export TIKTOKEN_CACHE_DIR
elif [[ -z "${TIKTOKEN_CACHE_DIR:-}" ]]; then
  echo "gpu_check: no $wheels/tiktoken-cache: the tests that read GPT-2's BPE files skip. To carry them:"
  echo "  cp -r ../shared/data/tiktoken-cache $wheels/"
fi
# eqx_gpt's dependencies (pyproject.toml), looked up without importing them.
missing=$("$py" -c 'import importlib.util as u, sys; print(*(m for m in sys.argv[1:] if not u.find_spec(m)))' \
  jax equinox optax jaxtyping beartype tiktoken matplotlib numpy safetensors)
if [[ -n "$missing" ]]; then
  echo "gpu_check: $py lacks $missing; bring it as wheels, as for beartype: $prepare" >&2
fi

mkdir -p "$out"
rm -f "$out/gpu_check.json"
"$py" bench/gpu_check.py --wheels "$installed" "${args[@]}"
rc=$?
if [[ ! -s "$out/gpu_check.json" ]]; then  # the orchestrator itself died: still leave a record
  printf '{"error": "bench/gpu_check.py exited %s before writing its report", "python": "%s"}\n' "$rc" "$py" \
    >"$out/gpu_check.json"
  echo "gpu_check: bench/gpu_check.py exited $rc before writing its report" >&2
fi
exit $rc
