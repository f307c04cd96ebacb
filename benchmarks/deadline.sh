# Sourced by the side-by-side GPU scripts (shapes_bf16.sh, shapes_long_and_objectives.sh) after they
# set `start=$(date +%s)`: until_s S prints Lightning's max_time, DD:HH:MM:SS, for a run that must
# stop S seconds after the start (at least 30 seconds from now).
until_s() { local s=$(($1 - ($(date +%s) - start))); s=$((s > 30 ? s : 30)); printf '00:%02d:%02d:%02d' $((s / 3600)) $((s % 3600 / 60)) $((s % 60)); }
