"""gdsckpt inside the training frameworks people already use. Each module imports its framework
and is an optional extra; `import gdsckpt` imports none of them.

    gdsckpt.integrations.lightning     GdsckptCheckpointIO, a Lightning CheckpointIO  (gdsckpt[lightning])
    gdsckpt.integrations.accelerate    save_state / load_state for an Accelerator       (gdsckpt[accelerate])
    gdsckpt.integrations.transformers  GdsckptTrainer, a transformers.Trainer           (gdsckpt[transformers])
    gdsckpt.integrations.torchtitan    GdsckptCheckpointManager, torchtitan's DCP checkpointer through
                                       GdsckptWriter / GdsckptReader                    (gdsckpt[torchtitan])
    gdsckpt.integrations.deepspeed     use_gdsckpt(engine): a DeepSpeed CheckpointEngine for
                                       engine.save_checkpoint / load_checkpoint         (gdsckpt[deepspeed])
    gdsckpt.integrations.megatron      Megatron-core dist_checkpointing save / load strategies and an
                                       AsyncCallsQueue with no worker process          (gdsckpt[megatron])
"""
