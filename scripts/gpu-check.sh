#!/usr/bin/env bash
# The checks that need a CUDA GPU and skip everywhere else: the CuPy kernels against the CPU
# reference, and the trainer with its model on the GPU across real worker processes
# (tests/test_gpu.py). Run it from the repository root on a machine with a GPU, with the
# interpreter that holds a CUDA build of torch (PYTHON, default python3); it builds the Cython
# codec in place and runs those tests with the repository on the path.
set -euo pipefail
PY=${PYTHON:-python3}
"$PY" setup.py -q build_ext --inplace
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import torch; from poseidon_aio import kernels, wire; print('torch', torch.__version__, torch.cuda.get_device_name(0), '| CuPy kernels:', kernels.cuda_available(), '| codec:', wire.CODEC)"
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py "$@"
