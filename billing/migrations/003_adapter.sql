-- The LoRA adapter that served each attempt: '' for the base model (model stays the base
-- model's name, so the rollups by model keep counting adapter traffic under its base).
-- Rows written before this migration read ''.
ALTER TABLE usage_events
    ADD COLUMN IF NOT EXISTS adapter LowCardinality(String) DEFAULT '' AFTER model;
