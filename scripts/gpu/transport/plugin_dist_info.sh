# Sourced by stage2.sh and rehearse_torch211.sh. The plugin's entry point, as
# an editable install would declare it, in a --target site folder; the code
# itself comes from this checkout (on PYTHONPATH).
write_plugin_dist_info() {  # write_plugin_dist_info SITE
    local dist=$1/vllm_kvmem-0.1.0.dist-info
    mkdir -p "$dist"
    printf 'Metadata-Version: 2.1\nName: vllm-kvmem\nVersion: 0.1.0\n' >"$dist/METADATA"
    printf '[vllm.general_plugins]\nkvmem = vllm_kvmem.plugin:register\n\n[console_scripts]\nkvmem = vllm_kvmem.cli:main\n' \
        >"$dist/entry_points.txt"
}
