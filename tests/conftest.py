import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (hf_reference) import by name
