"""`fedge privacy ...`: the exact JSON contract, and the Kim et al. comparison table."""

from __future__ import annotations

import json

import pytest

from tools.cli import main


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_epsilon_json_contract(capsys) -> None:
    base = ["privacy", "epsilon", "--noise-multiplier", "1.1", "--sample-rate", "0.01",
            "--steps", "1000", "--delta", "1e-5", "--json"]
    out = _json(capsys, base)
    assert set(out) >= {"epsilon", "delta", "accountant"}
    assert out["accountant"] == "pld" and out["delta"] == 1e-5
    rdp = _json(capsys, [*base, "--accountant", "rdp"])
    zcdp = _json(capsys, [*base, "--accountant", "zcdp"])
    # PLD is the tightest; zCDP claims no subsampling amplification.
    assert out["epsilon"] <= rdp["epsilon"] <= zcdp["epsilon"]
    wor = _json(capsys, ["privacy", "epsilon", "--noise-multiplier", "1.1", "--steps", "100",
                         "--delta", "1e-5", "--sampling", "without-replacement",
                         "--batch-size", "10", "--dataset-size", "1000", "--json"])
    assert wor["epsilon"] > 0 and wor["accountant"] == "rdp"


def test_without_replacement_uses_the_substitution_sensitivity(capsys) -> None:
    """Finding 7 of issue 14: z is relative to the clip bound C, but the without-replacement
    bound is stated under substitution, whose sensitivity is 2C. At noise std = C (z = 1),
    B = 32 of m = 600, 20 steps, the old CLI evaluated the bound at z = 1 and printed 3.44;
    the mechanism's substitution multiplier is 1/2, epsilon 15.54."""
    from edge_sdk.privacy import RdpAccountant, SampledWithoutReplacementGaussian

    out = _json(capsys, ["privacy", "epsilon", "--noise-multiplier", "1", "--steps", "20",
                         "--delta", "1e-5", "--sampling", "without-replacement",
                         "--batch-size", "32", "--dataset-size", "600", "--json"])
    true = RdpAccountant(adjacency="substitution").compose(SampledWithoutReplacementGaussian(
        noise_multiplier=0.5, sample_size=32, dataset_size=600, steps=20)).get_epsilon(1e-5)
    assert out["epsilon"] == pytest.approx(true, rel=1e-12)
    assert out["epsilon"] == pytest.approx(15.54, abs=0.01)  # was 3.44


def test_noise_json_contract_round_trips(capsys) -> None:
    out = _json(capsys, ["privacy", "noise", "--epsilon", "2", "--delta", "1e-5",
                         "--sample-rate", "0.01", "--steps", "500", "--accountant", "rdp",
                         "--json"])
    assert out["epsilon"] <= 2.0
    z = str(out["noise_multiplier"])
    back = _json(capsys, ["privacy", "epsilon", "--noise-multiplier", z,
                          "--sample-rate", "0.01", "--steps", "500", "--delta", "1e-5",
                          "--accountant", "rdp", "--json"])
    assert back["epsilon"] == pytest.approx(out["epsilon"])


def test_missing_sample_rate_is_a_clear_error(capsys) -> None:
    assert main(["privacy", "epsilon", "--noise-multiplier", "1", "--steps", "10",
                 "--delta", "1e-5"]) == 2
    assert "--sample-rate is required" in capsys.readouterr().err


def test_kim_table_recomputes_and_adds_tight_rows(capsys) -> None:
    out = _json(capsys, ["privacy", "kim-table", "--json"])
    rows = {r["method"]: r for r in out["rows"]}
    assert set(rows) == {"proposed", "ma", "ac1", "ac2", "fedge rdp (tight)",
                         "fedge pld (tight)"}
    assert rows["proposed"]["reported_utility"] == 25.83
    # Tightest first: PLD certifies less noise than RDP; MA and AC2 ask for more still.
    pld, rdp = rows["fedge pld (tight)"]["sigma_k2"], rows["fedge rdp (tight)"]["sigma_k2"]
    assert pld < rdp < rows["ma"]["sigma_k2"] < rows["ac2"]["sigma_k2"]
    # AC1 as printed asks for less noise than a sound accountant certifies.
    assert rows["ac1"]["sigma_k2"] < pld
