"""The repository stage and serving: the request schema, the Triton model repository, the server, its clients."""
