"""enginesmith CUDA plugins: TensorRT IPluginV3 wrappers (C++/CUDA, built by CMakeLists.txt) and a
ctypes test binding (kernels.py) with PyTorch references (reference.py). See README.md."""
