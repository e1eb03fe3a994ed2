"""dgpipe: take a DiffusionGemma checkpoint to a Triton fleet. Import name `pipeline`, distribution `dgpipe`."""

__version__ = "0.1.0"
