"""What every layer stands on: reading and showing values, reading files safely, the machine's memory, the circuit breaker.
May import: errors only."""
