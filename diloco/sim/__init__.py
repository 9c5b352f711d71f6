"""A virtual-clock simulator of Decoupled DiLoCo: M learners in one process, real training, simulated time."""
