"""What the engine measures of the machine it runs on: the device and its dtypes, memory probes,
the device's measured limits (matmul peak, bandwidth) and the roofline's cost model of a step."""
