"""The tenants ops tool (python -m clients.tenants): a new key is printed once, only its digest is stored,
and the file stays one the gateway accepts."""
import shutil
from pathlib import Path

import pytest
import yaml

from gateway.tenants import ConfigError, hash_key, parse_config
from clients.tenants import DEFAULT, add_tenant, main


def test_add_stores_only_the_digest_and_keeps_the_file_valid(tmp_path):
    path = tmp_path / "gateway.yaml"
    shutil.copy(DEFAULT, path)
    key = add_tenant(path, "newco", "standard", {"tokens_per_minute": 1234}, ["tensorrt_llm"])
    text = path.read_text()
    assert key.startswith("sk-") and key not in text and hash_key(key) in text
    cfg = parse_config(yaml.safe_load(text))
    assert "newco" in {t.name for t in cfg.tenants.values()}
    with pytest.raises(ConfigError, match="already exists"):
        add_tenant(path, "newco", "standard", {}, None)


def test_the_cli_refuses_an_unknown_tier_without_writing(tmp_path, capsys):
    path = tmp_path / "gateway.yaml"
    shutil.copy(DEFAULT, path)
    before = path.read_text()
    assert main(["add", "x", "--tier", "no-such-tier", "--config", str(path)]) == 2
    assert path.read_text() == before and "error" in capsys.readouterr().err
