# The two commands of the README. Both set up what they need first (tools/setup.sh).
.PHONY: fleet test setup onepath

# the fleet over mosquitto, then the same fleet without noise on the fast path (the same
# model code): what the privacy costs, printed beside
fleet: setup
	.venv/bin/fedge simulate --config tools/configs/fleet.toml --beside-no-noise --json-out out/fleet.json

test:
	bash tools/test.sh

# issue 15's one-path check: per mechanism, the fast simulator, the in-process fleet and
# the MQTT fleet end with the same model (one distinct model_sha256 each)
FEDGE ?= .venv/bin/fedge
onepath: setup
	@mkdir -p out/onepath
	@for c in "gaussian|--mechanism gaussian" \
	          "gaussian-randk-qsgd|--mechanism gaussian --sparsity 0.1 --quant-levels 7" \
	          "update-noise|--mechanism update-noise" "ddg|--mechanism ddg --local-steps 1" \
	          "binomial|--mechanism binomial --binomial-trials 1024 --quant-levels 31" \
	          "device-dp|--mechanism device-dp --update-clip 1" \
	          "device-dp-adaptive|--mechanism device-dp --update-clip 1 --adaptive-clip-quantile 0.5"; do \
	  name=$${c%%|*}; args=$${c#*|}; \
	  for mode in "--no-secagg" "--secagg --transport inproc" "--secagg --transport mqtt"; do \
	    $(FEDGE) simulate --config tools/configs/onepath.toml $$args $$mode --quiet \
	      --json-out "out/onepath/$$name-$$(echo $$mode | tr ' ' _).json" > /dev/null || exit 1; \
	  done; \
	  n=$$(cat out/onepath/$$name-*.json | grep -o '"model_sha256": "[0-9a-f]*"' | sort -u | wc -l); \
	  echo "$$name: $$n distinct model(s)"; [ "$$n" = 1 ] || exit 1; \
	done

setup:
	bash tools/setup.sh
	@mkdir -p out
