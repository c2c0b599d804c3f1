#!/usr/bin/env bash
# Here, before a lent GPU's first call (issue 29: 15 minutes of device time in all, so nothing may be
# fetched or fixed there). Puts into the repository's ignored folders what bench/gpu_session.sh needs:
#   .whl/    wheels for the device's Python 3.12 of the packages its image lacks or holds in another
#            version (its torch 2.11 stays: a CUDA torch wheel is over the 64 MiB a call carries)
#   .peers/  the sd-scripts and musubi-tuner sources bench_peers.py imports (no .git, no docs)
# then checks the imports here with the packages the device lacks hidden, and prints the call to make.
#   bash bench/gpu_prepare.sh SD_SCRIPTS_DIR MUSUBI_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
sd_scripts=${1:?usage: bash bench/gpu_prepare.sh SD_SCRIPTS_DIR MUSUBI_DIR}
musubi=${2:?usage: bash bench/gpu_prepare.sh SD_SCRIPTS_DIR MUSUBI_DIR}
PY=${PYTHON:-.venv/bin/python}
# The pins of requirements.txt for what the device image lacks (diffusers, prodigyopt, toml) or holds
# older (transformers 5.17, its tokenizers); peft too, so both machines run the same LoRA code.
WHEELS="diffusers==0.42.1 transformers==5.23.0 tokenizers==0.23.3 peft==0.21.2 prodigyopt==1.1.2 toml==0.10.2"
rm -rf .whl .peers
mkdir -p .whl .peers/sd-scripts .peers/musubi-tuner
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms="$platforms --platform $p"
done
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms -d .whl $WHEELS
cp -r "$sd_scripts/library" "$sd_scripts/networks" .peers/sd-scripts/
cp -r "$musubi/src" .peers/musubi-tuner/
find .peers -name __pycache__ -prune -exec rm -rf {} +
# The imports bench_peers.py makes, here, with what the device image lacks hidden from Python
# (bitsandbytes, gguf, lycoris, gradio, playwright: the benches must not need them).
hide=$(mktemp -d)
cat >"$hide/sitecustomize.py" <<'EOF'
import importlib.machinery as machinery

HIDDEN = {"bitsandbytes", "gguf", "lycoris", "gradio", "playwright"}
_find_spec = machinery.PathFinder.find_spec.__func__


def find_spec(cls, name, path=None, target=None):
    return None if name.split(".")[0] in HIDDEN else _find_spec(cls, name, path, target)


machinery.PathFinder.find_spec = classmethod(find_spec)
EOF
(cd bench && PYTHONPATH="$hide" "../$PY" -c "
import bench_peers, bench_train_step, bench_block_swap, bench_core_levers
bench_peers.import_sd_scripts('../.peers/sd-scripts')
bench_peers.import_musubi('../.peers/musubi-tuner')
print('imports: ok without', 'bitsandbytes, gguf, lycoris, gradio, playwright')" 2>&1 | grep -v sageattention)
rm -rf "$hide"
du -sh .whl .peers
# (one stat over every tracked file: `xargs du -c` prints a total per batch of names and summed only the last)
tracked=$(git ls-files -z | xargs -0 stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}')
carried=$(du -sb .whl .peers | awk '{s += $1} END {print s}')
echo "travels: $(( (tracked + carried) / 1048576 )) MiB of the 64 MiB a call may carry"
if (( tracked + carried > 64 * 1048576 )); then
    # the learned bases (tracked, ~110 MiB): only `families` reads one (its quickstart: learned/nucleus_image,
    # 4 MiB; keep that folder for it). Out of the index for the lease (the device copies what the index
    # tracks), back afterwards; nothing is committed either way.
    echo "over: leave learned/ behind for the lease: echo /learned/ >> .git/info/exclude; git rm -r -q --cached learned"
    echo "      afterwards: git reset -q -- learned; sed -i '\\#^/learned/\$#d' .git/info/exclude"
fi
echo "then: device run, carry [\".whl\", \".peers\"], timeout_s 600, command: bash bench/gpu_session.sh headline 560"
