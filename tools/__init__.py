"""The command-line tools beside npllama (benchmarks, PyTorch cross-checks), a package so that
they and the tests share modules: `from tools.torch_llama import TorchLlama`. The npllama
package never imports from here; the wheel does not carry it.
"""
