"""The pure core of Decoupled DiLoCo: no gRPC, no clocks, no I/O. Time is always a parameter (`now`)."""
