"""Batch containers and shape conversions: DataProto, nested (jagged) <-> padded / packed, serialization."""
