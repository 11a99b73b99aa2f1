#!/usr/bin/env bash
# The Python wheels a lent GPU machine lacks, fetched here into .whl/ (ignored by git) so that a device run can
# carry them: that machine reaches no package registry, and its image holds torch, numpy, psutil, rich,
# matplotlib, tensorboard, typing-extensions and DeepSpeed's einops, msgpack, ninja, py-cpuinfo, tqdm, packaging,
# nvidia-ml-py, but not podscale's pydantic (with its pydantic-core, annotated-types, typing-inspection),
# rocksdict or pymetis, nor DeepSpeed and its hjson (bench/moe.py's peer).  The versions are the ones the test
# suite runs with here; the target is CPython 3.12 on x86-64 Linux (the machine's python3).  DeepSpeed has no
# wheel on PyPI: it is built here from its sdist as a pure-Python wheel (DS_BUILD_OPS=0: no op is compiled,
# its MoE layer needs none).
#
#   bash bench/gpu_wheels.sh
#   then, on the device (run with carry [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && python3 bench/gpu_check.py \
#       --data tests/data/tinyshakespeare.txt --out $OUT [--skip adam,correctness,memory,throughput,profile]
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
    rocksdict==0.3.29 pymetis==2025.2.2 hjson==3.1.0
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
ls -l .whl
du -sh .whl
