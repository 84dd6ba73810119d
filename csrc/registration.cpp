// Every hasten op schema, declared once. Implementations register per backend in
// their own files (<family>/<op>_cpu.cpp, <family>/<op>_cuda.cu).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import hasten._C` loads this shared object, which runs the static TORCH_LIBRARY
// initialisers below; the Python module itself has no functions.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(hasten, m) {
  // Packing metadata from position_ids of shape (..., L), flattened to T tokens.
  // A sequence starts at the first token of every row and wherever
  // position_ids[i] != position_ids[i-1] + 1.
  //   cu_seqlens (int32, T+1): cu_seqlens[0..N] are the N+1 boundaries; the tail
  //     cu_seqlens[N+1..T] repeats T so the shape depends on T only (no host sync).
  //   seq_idx    (int32, T):   index of the sequence each token belongs to.
  //   stats      (int32, 2):   [N, max_seqlen], read once per batch by the caller.
  m.def("varlen_meta(Tensor position_ids) -> (Tensor cu_seqlens, Tensor seq_idx, Tensor stats)");
}
