"""The architectures jaxserve runs, one module per family, listed here by config.json `model_type`."""

from __future__ import annotations

from jaxserve.errors import CheckpointError
from jaxserve.models import (bert, decoder, distilbert, eurobert, gemma3, gte, jina_bert, jina_v3, modernbert, mpnet,
                             nomic_bert)
from jaxserve.models.family import ArchConfig, Family

MODULES = (bert, decoder, distilbert, eurobert, gemma3, gte, jina_v3, modernbert, mpnet, nomic_bert)
FAMILIES: dict[str, Family] = {t: f.FAMILY for f in MODULES for t in f.FAMILY.model_types}


def family_of(raw: dict) -> Family:
    """The family that reads this config.json, or a CheckpointError listing the supported model types."""
    model_type = raw.get("model_type")
    if jina_bert.is_jina_bert(raw):  # JinaBERT v2 says model_type bert; its ALiBi positions tell it apart
        return jina_bert.FAMILY
    if jina_v3.is_jina_v3(raw):  # the hub's Jina-embeddings-v3 says model_type xlm-roberta; rotary positions
        return jina_v3.FAMILY
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r} in config.json (architectures={raw.get('architectures')}); "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def all_families() -> tuple[Family, ...]:
    """Every family, those found by their config's fields (JinaBERT) included."""
    return (*dict.fromkeys(FAMILIES.values()), jina_bert.FAMILY)


__all__ = ["ArchConfig", "FAMILIES", "Family", "all_families", "family_of"]
