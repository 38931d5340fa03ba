"""The samples being generated, below the KV cache and the scheduler: one sample and its answer
(sequence), the batch's next tokens and their logprobs (sampling, logprobs), when a sample stops
(next_token), and which waiting samples run together (admission_batch)."""
