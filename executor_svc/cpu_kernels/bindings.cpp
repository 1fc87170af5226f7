// The one Python module of the CPU kernels: each file registers its own functions.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_qlinear(m);
  register_layer_ops(m);
  register_decoder(m);
}
