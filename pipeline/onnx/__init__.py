"""The export stage: the network + sampler as one ONNX graph, its I/O contract, Q/DQ, and an ORT backend."""
