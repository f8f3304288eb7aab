"""`jaxserve embed`: reading a corpus, embedding it in order, and the resumable sinks it writes."""
