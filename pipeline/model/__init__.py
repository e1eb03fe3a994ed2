"""The model stage: DiffusionGemma's config, network and checkpoint I/O, and the ModelOpt-format reader."""
