"""How a trajectory is born: dataset rows, tokenizer, tasks, agent loops and post-processing into store fields."""
