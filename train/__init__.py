"""Training drafters: data (sources, chat rendering and loss masks, the Grain pipeline), data generation with the
target (`train.synthesize`, `train.regenerate`), and the train step, losses, optimiser and checkpoints."""
