"""From tokenized requests to device batches and back: packing, the batching queue, the flat job layout,
the device pipeline's threads and the latency math. Knows nothing of HTTP."""
