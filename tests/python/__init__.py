"""fastddp's pytest suite; a folder per family, mirroring fastddp's subpackages."""
