"""The test package. Imported before any conftest or test module, so before torch's inductor config, which reads
its environment once: inductor's CPU code takes the vector ISA the CPU reports without first building a probe per
ISA with the C++ compiler (about 6 s of g++ at the first compile of every process on a fresh cache); the kernels
are the same vectorized code. A value the caller set (TORCHINDUCTOR_VEC_ISA_OK=0 or 1) is kept."""

import os

os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
