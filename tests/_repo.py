"""The repository root, for tests that read files outside the package (bench/, scripts/, docs/)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
