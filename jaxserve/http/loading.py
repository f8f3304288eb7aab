"""Loading the model for serving: the checkpoint on its device (or a simulated one), its table warm, its
pipeline. Imports JAX: the one-process server and the engine process of `--workers N` use it, and a
front-end process never does (it gets the engine's `ModelView` instead: http/workers.py).
"""

from __future__ import annotations

import dataclasses
import logging

from jaxserve.encoder import Encoder
from jaxserve.http.state import ServerConfig
from jaxserve.runtime import device, startup
from jaxserve.runtime.buckets import BucketTable
from jaxserve.scheduling.pipeline import Pipeline, server_classes

log = logging.getLogger("jaxserve.http.loading")


def load_encoder(config: ServerConfig) -> Encoder:
    """The checkpoint, on its device; with `config.simulate`, on a simulated device instead (capacity planning:
    the real host path, no model run, zeros out)."""
    enc = Encoder.from_pretrained(config.model, dtype=config.dtype, devices=config.devices,
                                  attention=config.attention, task=config.task)
    if config.simulate is not None:
        from jaxserve.runtime.simulated import simulated_engine

        log.warning("SIMULATED DEVICE: no model runs; every output is zeros (--simulate-device, capacity planning)")
        engine = simulated_engine(enc.engine, enc.model_config, enc.embedding_config.max_seq_length, enc.out_dim,
                                  config.simulate)
        enc = dataclasses.replace(enc, engine=engine)
    return enc


def check_prompt(config: ServerConfig, encoder: Encoder) -> None:
    """A --default-prompt-name must be one of the model's prompts (InputError naming them)."""
    if config.default_prompt_name is not None:
        encoder.embedding_config.prompt(config.default_prompt_name)


def start_engine(cfg: ServerConfig, enc: Encoder, started: startup.Startup) -> BucketTable:
    """Ready the engine (blocking; runs in a thread while /health says 503): from the warm artifact when one
    matches, else compiled and timed, then saved. An encoder the caller warmed (tests, scripts, a simulated
    device) is used as is."""
    check_prompt(cfg, enc)
    # token outputs (`startup.outputs`: /embed_all's, a multi-vector model's, BGE-M3's); a simulated device has
    # pooled outputs only
    tokens = "tokens" in startup.outputs(enc, cfg.embed_all) and cfg.simulate is None
    if enc.engine.table is not None and cfg.buckets == "auto":
        started.source = {"source": "given"}
        if tokens and "tokens" not in enc.engine.tables:
            enc.warmup_tokens(progress=True)
        return enc.engine.table
    spec = BucketTable.load(cfg.buckets) if cfg.buckets != "auto" else cfg.table_options
    cache = startup.cache_root(cfg.cache_dir) if cfg.use_cache else None
    table = startup.start(enc, spec, cfg.embed_all and cfg.simulate is None, cache, started, progress=True,
                          keep=cfg.keep_artifacts)
    log.info("start-up: %s; table %s", started.summary(), started.source.get("source"))
    return table


def make_pipeline(cfg: ServerConfig, enc: Encoder, table: BucketTable, metrics) -> Pipeline:
    return Pipeline(enc.engine, table, cfg.max_wait_ms / 1000, cfg.max_queue_tokens, metrics,
                    max_inflight=cfg.max_inflight,
                    streams=cfg.streams or (1 if cfg.simulate is not None else device.streams()),
                    classes=server_classes(cfg.bulk_dispatch_ms / 1000),
                    host_dispatch_s=None if cfg.host_dispatch_us is None else cfg.host_dispatch_us * 1e-6)
