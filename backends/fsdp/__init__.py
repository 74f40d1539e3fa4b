"""The FSDP2 engine (registered as ``actor.backend = "fsdp"``), Ulysses sequence parallel and DCP checkpoints."""
