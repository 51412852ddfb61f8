"""Preference records on the chat data path, as the pipeline's `RecordReader`
(orchestrate/data/method_data.py): a record into its cached document (records.py), the cached
documents viewed as pairs or labelled answers (samples.py), and the run's loss checked against the
records it is given."""

from __future__ import annotations

from functools import partial

from orchestrate.config.schema import RunConfig
from orchestrate.data.method_data import RecordReader
from orchestrate.methods.preference.records import PREFERENCE_FORMATS, preference_document
from orchestrate.methods.preference.samples import (
    check_preference_records,
    describe_preferences,
    preference_views,
)


def data_path(config: RunConfig) -> RecordReader:
    return RecordReader(PREFERENCE_FORMATS, partial(check_preference_records, config.preference), preference_document,
                        preference_views, describe_preferences)
