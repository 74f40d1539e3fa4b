"""Backend-independent protocol: what a trajectory is and how it is born, stored, scored and cleared."""
