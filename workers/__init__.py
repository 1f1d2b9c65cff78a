"""GPU workers: a thin loop around vLLM's AsyncLLM, fed from Kafka."""
